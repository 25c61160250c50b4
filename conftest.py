"""pytest's settings for the doctests of the package (tests/ has its own).

`lazy_optax.haiku` imports Haiku, an optional dependency: its doctests are
collected only where Haiku is installed (the rest of the package never
imports it).
"""

import importlib.util

collect_ignore = ([] if importlib.util.find_spec('haiku') is not None
                  else ['lazy_optax/haiku.py'])
