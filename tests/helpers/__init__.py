"""What every test folder shares: the backends this machine has, exact error messages, tolerances."""
