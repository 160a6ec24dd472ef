"""Where a study finds what it imports: the repository (carnator_core, the tinyworld
package), tests/ (the request helpers) and, last, bench/ (bench/tinyworld.py and
bench/calibrate.py are scripts, not a package, and must not shadow ``tinyworld``).
A study imports this first: ``from study_paths import REPO``."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (os.path.join(REPO, "tests"), REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)
if os.path.join(REPO, "bench") not in sys.path:
    sys.path.append(os.path.join(REPO, "bench"))
