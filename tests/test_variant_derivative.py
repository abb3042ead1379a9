"""L0: symbolic derivatives of score mods and sinks (fa_gen.variant.derivative) against torch autograd,
and their emission with shared subexpressions (fa_gen.variant.shared).

The derivative is evaluated by the reference's own emitter (emit_torch) and compared with autograd
through that emitter, in float64, at random points: every shipped score mod, and random float
expressions from the test grammar (tests/variant_grammar.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen import generate
from fa_gen.variant import Role
from fa_gen.variant.derivative import derivative, reads_of, score_derivative
from fa_gen.variant.emit_cute import emit_cute
from fa_gen.variant.emit_torch import emit_torch
from fa_gen.variant.shared import emit_cute_shared, shared_subtrees
from fa_gen.variant.tree import Const, Name, Type, walk

from .variant_grammar import INPUTS, float_exprs, parse_or_reject, random_tensors

SCORE_MODS = [s for s in generate.shipped_specs() if s.score_mod_expr is not None]
POINTS = 512
SIZES = {"batch": 3, "heads_q": 4, "seqlen_q": 37, "seqlen_k": 53}


def _env(decls, generator: torch.Generator, values: dict | None = None) -> dict:
    """POINTS random (b, h, q_idx, kv_idx, score) points, sizes, and values for the inputs."""
    def ints(high):
        return torch.randint(0, high, (POINTS,), generator=generator)
    env = {"b": ints(SIZES["batch"]), "h": ints(SIZES["heads_q"]), "q_idx": ints(SIZES["seqlen_q"]),
           "kv_idx": ints(SIZES["seqlen_k"]), "seqlen_q": SIZES["seqlen_q"], "seqlen_k": SIZES["seqlen_k"],
           "heads_q": SIZES["heads_q"], "score": 4 * torch.randn(POINTS, generator=generator, dtype=torch.float64)}
    for decl in decls:
        if decl.is_scalar:
            env[decl.name] = decl.default if decl.default is not None else 1.5
    env.update(values or {})
    return env


def _by_autograd(tree, env) -> torch.Tensor:
    score = env["score"].clone().requires_grad_()
    value = emit_torch(tree)({**env, "score": score}).expand(POINTS)
    if not value.requires_grad:  # the expression does not read score
        return torch.zeros(POINTS, dtype=torch.float64)
    (grad,) = torch.autograd.grad(value.sum(), score, allow_unused=True)
    return torch.zeros(POINTS, dtype=torch.float64) if grad is None else grad


def _symbolic(tree, env) -> torch.Tensor:
    return emit_torch(score_derivative(tree))(env).expand(POINTS).to(torch.float64)


def _finite_everywhere(tree, env) -> torch.Tensor:
    """Points where every float part of `tree` is finite. Elsewhere an overflow decides what the
    chain rule gives (autograd's masked_fill turns inf * 0 into 0 where a product makes NaN), and
    the kernel's values there are inf or NaN anyway."""
    ok = torch.ones(POINTS, dtype=torch.bool)
    for node in walk(tree):
        if node.type is Type.FLOAT:
            ok &= torch.isfinite(emit_torch(node)(env).expand(POINTS))
    return ok


def _near_overflow(tree, env) -> torch.Tensor:
    """Points where some float part of `tree` has a magnitude above 1e300."""
    near = torch.zeros(POINTS, dtype=torch.bool)
    for node in walk(tree):
        if node.type is Type.FLOAT:
            near |= emit_torch(node)(env).expand(POINTS).abs() > 1e300
    return near


def _assert_agree(tree, env):
    """Where autograd has a finite gradient, the symbolic one is the same. (Where autograd gives
    inf or NaN, at sqrt(0) say, the symbolic one may be 0 or inf: the kernel need not copy that.)
    Left out as well: points where a part of the expression comes within a factor 1e8 of float64's
    overflow and a part of the symbolic derivative overflows; there the order of the chain rule's
    products decides (log(|2 ** exp(s)| + 1) at s = 6.92: 2 ** exp(s) is 1.6e305, the derivative's
    numerator 2 ** exp(s) * ln 2 * exp(s) passes 1.8e308 where autograd, dividing first, gets 704).
    A derivative that overflows away from such values still fails."""
    want, got = _by_autograd(tree, env), _symbolic(tree, env)
    overflow_order = _near_overflow(tree, env) & ~_finite_everywhere(score_derivative(tree), env)
    at = _finite_everywhere(tree, env) & torch.isfinite(want) & ~overflow_order
    torch.testing.assert_close(got[at], want[at], rtol=1e-9, atol=1e-12)


def _shipped_values(spec, generator) -> dict:
    values = {}
    for decl in spec.inputs:
        if not decl.is_scalar:
            shape = decl.resolved_shape(SIZES)
            values[decl.name] = torch.randn(shape, generator=generator, dtype=torch.float64).to(torch.float32)
    return values


@pytest.mark.parametrize("spec", SCORE_MODS, ids=[s.name for s in SCORE_MODS])
def test_shipped_score_mod_derivatives_match_autograd(spec):
    generator = torch.Generator().manual_seed(0)
    _assert_agree(spec.score_mod_tree, _env(spec.inputs, generator, _shipped_values(spec, generator)))


@pytest.mark.parametrize("name", ["alibi", "alibi_supplied", "relative_bias"])
def test_additive_score_mods_have_derivative_exactly_one(name):
    """The backward spends nothing on a mod whose derivative folds to the constant 1."""
    spec = next(s for s in SCORE_MODS if s.name == name)
    assert score_derivative(spec.score_mod_tree) == Const(Type.FLOAT, 1.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(text=float_exprs(), seed=st.integers(0, 2**31 - 1))
def test_random_expression_derivatives_match_autograd(text, seed):
    tree = parse_or_reject(text, Role.SCORE_MOD)
    generator = torch.Generator().manual_seed(seed)
    values = random_tensors(generator, SIZES["batch"], SIZES["heads_q"], SIZES["seqlen_q"], SIZES["seqlen_k"])
    _assert_agree(tree, _env(INPUTS, generator, values))


@pytest.mark.parametrize("text, at, want", [
    ("max(score, score)", 1.5, 1.0),         # a tie: half to each argument, as torch.maximum
    ("min(score, 2.0 * score)", 3.0, 1.0),   # score wins where positive
    ("min(score, 2.0 * score)", -3.0, 2.0),
    ("abs(score - 1.5)", 1.5, 0.0),           # torch's sign(0) = 0
    ("score ** 3", 2.0, 12.0),
    ("2 ** score", 0.0, 0.6931471805599453),
    ("where(q_idx > kv_idx, score * 3.0, -score)", 0.0, 3.0),
])
def test_subgradient_conventions(text, at, want):
    from fa_gen.variant import parse

    tree = parse(text, Role.SCORE_MOD)
    env = {"score": torch.tensor(at, dtype=torch.float64), "q_idx": 5, "kv_idx": 2}
    got = emit_torch(score_derivative(tree))(env)
    assert float(got) == pytest.approx(want, rel=1e-15)
    assert float(_by_autograd_at(tree, env)) == pytest.approx(want, rel=1e-15)


def _by_autograd_at(tree, env):
    score = env["score"].clone().requires_grad_()
    (grad,) = torch.autograd.grad(emit_torch(tree)({**env, "score": score}), score)
    return grad


def test_integer_subtrees_have_no_derivative():
    from fa_gen.variant import parse

    tree = parse("score + (q_idx // 3) * 0.5 + where(kv_idx > 3, 1.0, 2.0)", Role.SCORE_MOD)
    assert score_derivative(tree) == Const(Type.FLOAT, 1.0)


def test_sink_derivative_by_each_read():
    """d sink / d read, for each distinct read of a tensor: what carries dsink to its elements."""
    from fa_gen.variant import InputDecl, parse

    decls = (InputDecl("table", "float32", (8,)),)
    tree = parse("table[h % 8] * 2.0 + 0.5 * table[(h + 3) % 8] ** 2", Role.SINK, decls)
    first, second = reads_of(tree, "table")
    assert derivative(tree, first) == Const(Type.FLOAT, 2.0)
    env = {"h": torch.arange(4), "table": torch.linspace(-1, 1, 8, dtype=torch.float64)}
    slope = emit_torch(derivative(tree, second))(env)
    torch.testing.assert_close(slope, env["table"][(torch.arange(4) + 3) % 8], rtol=0, atol=1e-15)


def test_value_and_derivative_share_their_tanh():
    spec = next(s for s in SCORE_MODS if s.name == "softcap")
    tree = spec.score_mod_tree
    slope = score_derivative(tree)
    names = {"score": "score", "softcap": "c", "q_idx": "q_idx", "kv_idx": "kv_idx"}
    levels = [{"q_idx"}, {"kv_idx", "score"}]
    code = emit_cute_shared([tree, slope], names, levels=levels, fastmath=True, temp_prefix="sg_")
    text = "\n".join(t for level in code.bindings for _, t in level) + "\n".join(code.exprs)
    assert text.count("tanh(") == 1
    # The tanh is per element (it reads score): bound at the innermost level, used by both.
    (temp, _), = [b for b in code.bindings[2] if "tanh(" in b[1]]
    assert temp in code.exprs[0] and temp in code.exprs[1]
    # Emitted alone, the value is the forward's expression.
    alone = emit_cute(tree, names, levels=levels, fastmath=True, temp_prefix="sg_")
    assert alone.expr.count("tanh(") == 1


def test_shared_subtrees_counts_a_repeat_inside_a_repeat_once():
    from fa_gen.variant import parse

    tree = parse("tanh(score * 2.0) + tanh(score * 2.0) * exp(score * 2.0)", Role.SCORE_MOD)
    shared = shared_subtrees([tree])
    texts = {type(n).__name__ + ":" + getattr(n, "func", getattr(n, "op", "")) for n in shared}
    # tanh(score * 2) twice, and score * 2 inside it and inside exp: both shared, tanh once.
    assert texts == {"Call:tanh", "Binary:*"}
    assert all(not isinstance(n, (Name, Const)) for n in shared)
    assert all(sum(1 for m in walk(tree) if m == n) >= 2 for n in shared)
