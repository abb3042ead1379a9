"""The variant language: mask, score-mod and sink expressions written in a spec.

One parse (`parse.parse`: text -> typed tree, whitelisted, type-checked, folded),
then emitters and analyses over the tree, each in its own module:
  emit_torch   tree -> function on torch tensors (the float64 reference)
  emit_cute    tree -> CuTe DSL expression text for the kernel templates
  intervals    interval arithmetic: what a tree can evaluate to over ranges of its names
  tiles        per-call ALWAYS / NEVER / MAYBE of every (query tile, key tile) under a mask
  bind         checking a caller's values for the spec's declared inputs
Only the torch-free modules are imported here: `import fa_gen` must not import torch.
"""

from .inputs import InputDecl
from .language import Role
from .parse import ExprError, canonical, parse, parse_cached
from .tree import Type

__all__ = ["ExprError", "InputDecl", "Role", "Type", "canonical", "parse", "parse_cached"]
