"""The variant language: mask, score-mod and sink expressions written in a spec.

One parse (`parse.parse`: text -> typed tree, whitelisted, type-checked, folded),
then emitters and analyses over the tree, each in its own module:
  emit_torch   tree -> function on torch tensors (the float64 reference)
  emit_cute    tree -> CuTe DSL expression text for the kernel templates
  intervals    interval arithmetic: what a tree can evaluate to over ranges of its names
  tiles        per-call ALWAYS / NEVER / MAYBE of every (query tile, key tile) under a mask, and
               the tile lists the forward (per query tile) and the backward (per key tile) walk
  bind         checking a caller's values for the spec's declared inputs
  derivative   d(tree)/d(leaf): a score mod's by the score, a sink's by an input element
  shared       several trees emitted together, each shared subtree computed once
  sink_grad    the gradient of the tensors a sink expression reads
Only the torch-free modules are imported here: `import fa_gen` must not import torch.
"""

from .inputs import InputDecl
from .language import Role
from .parse import ExprError, canonical, parse, parse_cached
from .tree import Type

__all__ = ["ExprError", "InputDecl", "Role", "Type", "canonical", "parse", "parse_cached"]
