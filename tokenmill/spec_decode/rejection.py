"""Rejection sampling: the lossless verification of an unseeded sampled request's drafts.

Such a request samples from the target's distribution p (after temperature, top-k, top-p, min-p); its
drafts came from a proposer's distribution q: a draft model's, sampled, or a point mass (prompt lookup;
a greedy draft). Draft j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first one
refused, the token is drawn from norm(max(0, p_j - q_j)) instead and the rest are dropped; when every
draft is kept, the token after them is the target's own sample at that row (the bonus token). The
tokens so produced follow p exactly, position after position, whatever q is (Leviathan et al. 2023,
Chen et al. 2023): P(d) = q(d) min(1, p(d)/q(d)) + (1 - sum min(p, q)) max(0, p(d) - q(d)) / (1 - sum
min(p, q)) = p(d). A seeded request never comes here: it keeps the drafts equal to its own (seed,
position) samples, so that its output does not depend on speculation at all.

The uniform draws and the residual's sample come from a generator per request and step, seeded from
the request's seed and output position on a stream of their own (`REJECTION_STREAM`), apart from the
target's samples and a draft model's guesses: independent of both, and reproducible from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import generator_seed

REJECTION_STREAM = 0x5EC0_DE05_ACCE_5700  # xor-ed into a request's seed: the stream of its acceptance draws


@dataclass
class Verification:
    """One unseeded sampled request's drafts in this step's sampling rows."""

    first_row: int  # its first sampling row: rows first_row .. first_row + len(drafts), in order
    drafts: list[int]  # [k] the draft tokens
    draft_probs: torch.Tensor | None  # [k, V] q at each draft position; None: point masses on the drafts
    seed: int  # the request's (engine-drawn) seed
    output_position: int  # output index of the token its first row samples


class RejectionSampler:
    """Stateless; `residual` is the distribution a refused draft's position is drawn from."""

    def resample(self, probs: torch.Tensor, tokens: torch.Tensor, verifications: list[Verification]) -> torch.Tensor:
        """probs [R, V] (the target's p at each sampling row), tokens [R] (its own sample at each row) ->
        [R]: each verified request's rows rewritten as the drafts it keeps, then the token drawn where
        the first was refused (or its own sample after the last: the bonus); other rows as they were.
        The caller keeps a request's drafts while they equal its rows' tokens: the residual never
        holds a refused draft (refused means q(d) > p(d), so max(0, p - q) is 0 there)."""
        out = tokens.clone()
        for v in verifications:
            k = len(v.drafts)
            rows = probs[v.first_row : v.first_row + k + 1]  # [k + 1, V]
            drafts = torch.tensor(v.drafts, dtype=torch.int64, device=probs.device)  # [k]
            p = rows[:k].gather(1, drafts.unsqueeze(1)).squeeze(1)  # [k]
            q = torch.ones_like(p) if v.draft_probs is None else v.draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(generator_seed(v.seed ^ REJECTION_STREAM, v.output_position))
            u = torch.rand(k, generator=generator, device=probs.device)  # [k] in [0, 1)
            refused = (u * q >= p).nonzero()  # kept with probability min(1, p / q)
            kept = k if refused.numel() == 0 else int(refused[0, 0])
            out[v.first_row : v.first_row + kept] = drafts[:kept]
            if kept < k:
                q_row = (
                    torch.zeros_like(rows[kept]).index_fill_(0, drafts[kept : kept + 1], 1.0)
                    if v.draft_probs is None
                    else v.draft_probs[kept]
                )
                residual = self.residual(rows[kept], q_row)  # [V]
                if float(residual.sum()) <= 0:  # p == q to the last bit: a refusal cannot have happened
                    residual = rows[kept]
                out[v.first_row + kept] = torch.multinomial(residual, 1, generator=generator)[0]
        return out

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """p, q [V] -> [V]: max(0, p - q), unnormalised (multinomial normalises)."""
        return (p - q).clamp_(min=0.0)
