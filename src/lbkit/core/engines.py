"""Service states of the engines (prefill) and ranks (decode) a balancer routes to.

Both balancers keep one state per unit in an ``int8`` array:

- ``ACTIVE`` (0): in service and taking new requests;
- ``DRAINING`` (1): in service, finishing the requests it holds, taking no new ones (a prefill
  engine moving to another length bucket, a decode rank being emptied);
- ``OUT`` (2): out of service, holding nothing.

``STATE_NAMES[state]`` is the name the balancers' statistics report.

Examples
--------
>>> STATE_NAMES[DRAINING]
'draining'
"""

from __future__ import annotations

__all__ = ["ACTIVE", "DRAINING", "OUT", "STATE_NAMES"]

#: In service and taking new requests.
ACTIVE = 0
#: In service, finishing what it holds, taking nothing new.
DRAINING = 1
#: Out of service, holding nothing.
OUT = 2
#: Name of each state, indexed by its code.
STATE_NAMES = ("active", "draining", "out")
