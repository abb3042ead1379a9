"""Judging greedy generate() of two implementations of one model (shared by the CPU and GPU tests).

Greedy decoding amplifies rounding: where the two best tokens of a step are nearly tied, a rounding
difference of either implementation may pick the other, and every later step then differs too. So
the tokens must agree, and a row may part only at a step where the float32 reference logits of the two
tokens chosen are within the noise measured for that run; after that point the row is not judged.
"""

from __future__ import annotations

import torch


def generation_run(steps: int, mask: torch.Tensor) -> dict:
    """generate()'s arguments: exactly `steps` greedy tokens, each step's raw logits returned."""
    return dict(attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                return_dict_in_generate=True, output_logits=True, pad_token_id=0)


def forced_logits(model, sequences: torch.Tensor, mask: torch.Tensor, prompt: int) -> torch.Tensor:
    """`model`'s float32 logits teacher-forced on `sequences` (a left-padded prompt of `prompt`
    tokens, then the new ones): the logits that chose each new token, (batch, steps, vocab). Each
    row runs alone without its padding, so no padding convention of `model` enters the reference."""
    rows = []
    with torch.no_grad():
        for row in range(sequences.shape[0]):
            start = int((mask[row] == 0).sum())
            logits = model(input_ids=sequences[row:row + 1, start:]).logits
            rows.append(logits[0, prompt - start - 1:-1].float())
    return torch.stack(rows)


def step_logits(generated) -> torch.Tensor:
    """The logits generate() returned for each step, (batch, steps, vocab) float32."""
    return torch.stack(generated.logits, dim=1).float()


def agreeing_steps(ours: torch.Tensor, theirs: torch.Tensor, reference: torch.Tensor, noise: float) -> list[int]:
    """Steps each row's new tokens agree; AssertionError where a row parts with a reference margin
    between the two tokens above `noise`. ours/theirs: (batch, steps) token ids; reference: float32
    logits (batch, steps, vocab) teacher-forced on `ours`."""
    agreed = []
    for row in range(ours.shape[0]):
        differ = (ours[row] != theirs[row]).nonzero()
        if differ.numel() == 0:
            agreed.append(ours.shape[1])
            continue
        t = int(differ[0])
        a, b = int(ours[row, t]), int(theirs[row, t])
        margin = abs(float(reference[row, t, a] - reference[row, t, b]))
        assert margin <= noise, f"row {row} step {t}: tokens {a} vs {b}, reference margin {margin:.3e} > {noise:.3e}"
        agreed.append(t)
    return agreed
