"""A torch stand-in for fa_gen.combine.combine_splits (same contract), for ad hoc checks of the split
forward where the combine kernel is absent."""
import torch


def torch_combine(o_partial, lse_partial, out, lse, arch=None):
    m = lse_partial.max(0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_partial - m_safe)
    s = w.sum(0)
    lse.copy_(torch.where(s > 0, torch.log(s) + m_safe, torch.full_like(s, -float("inf"))))
    wn = (w / s.clamp_min(1e-30)).permute(0, 2, 1).unsqueeze(-1)
    out.copy_((o_partial * wn).sum(0).to(out.dtype))


