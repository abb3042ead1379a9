"""Template families in preference order: the first that can implement a (spec, arch) serves it."""

from .sm80 import Sm80Family
from .sm90 import Sm90Family
from .sm90_mla import Sm90MlaFamily
from .sm100 import Sm100Family
from .sm75 import Sm75Family

# Hopper first: sm90 serves sm_90a by preference; sm80 stays reachable with build(..., family="sm80").
# sm100 (tcgen05, tensor memory) is opt-in until a Blackwell GPU has run it: after sm80, which
# serves sm_100a/sm_103a by default; build(..., family="sm100") reaches it.
# sm90_mla serves the MLA head-dim pair (576, 512) alone, which no other family takes.
REGISTRY = (Sm90Family(), Sm80Family(), Sm100Family(), Sm90MlaFamily(), Sm75Family())

__all__ = ["REGISTRY", "Sm75Family", "Sm80Family", "Sm90Family", "Sm90MlaFamily", "Sm100Family"]
