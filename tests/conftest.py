"""Hypothesis profiles: "ci" (small, used when CI is set), "dev" (default), "slow" and "thorough" (many
more examples: HYPOTHESIS_PROFILE=slow), and
"mutation" (HYPOTHESIS_PROFILE=mutation mutmut run: no shrinking, so a mutant that fails a property
is reported killed at once instead of timing out while hypothesis minimises its example)."""

import os

from hypothesis import HealthCheck, Phase, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, derandomize=True, **_common)
settings.register_profile("dev", max_examples=100, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.register_profile("slow", max_examples=1000, **_common)  # the property tests with many more examples
settings.register_profile("mutation", max_examples=50, derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
