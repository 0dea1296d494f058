"""The fuzz driver: random attention calls on every backend, checked against a float64 reference.

    python -m mha.tools.fuzz --cases 20000 --seed 1      run; exit 1 when anything is found
    python -m mha.tools.fuzz --replay '<case json>'      one case again, with what is wrong with it

    cases      Case (every choice of one call) and draw(rng)
    reference  the float64 reference and torch's own computation, written with torch's plain ops,
               and the tolerance rule (2x torch's own error in the dtype, plus a rounding floor)
    properties check(case): the properties every backend must have, and what breaks them
    driver     child processes (a crash or a hang is a finding, not the end of the run), findings
               reported once each with their smallest case, the command line
"""

from . import driver, properties
from .cases import Case, draw
from .properties import Finding, check

__all__ = ["Case", "Finding", "check", "draw", "driver", "properties"]
