"""The MTP layer's draft forward replayed from the draft graphs (engine/spec_graphs.py): which
rows fit them, and how a batch's committed rows are laid out in a graph's k + 1 rows per
sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from glmflash.utils.device import upload

if TYPE_CHECKING:
    from glmflash.engine.spec_runner import MtpRows


class DraftGraphMixin:
    """`SpecRunner`'s draft replays (needs its `graphs`, `runner`, `model` and
    `_committed_rows`)."""

    def fits_draft_graph(self, rows: MtpRows) -> bool:
        """`rows` fit the draft graphs: each sequence has at most k + 1 positions, none whose
        next tokens include a media prompt's visual rows."""
        graphs = self.graphs
        return graphs is not None and bool(graphs.verify_graphs) and \
            all(count <= graphs.rows_per_seq and
                (seq.prompt_embeds is None or start + 1 >= seq.num_prompt_tokens)
                for seq, start, count in zip(rows.seqs, rows.starts, rows.counts, strict=True))

    @torch.inference_mode()
    def draft_in_graph(self, rows: MtpRows, num_drafting: int) -> tuple[torch.Tensor, list[int]]:
        """`draft_extend` replayed from the draft graphs (`fits_draft_graph`), as many
        sequences at a time as the largest holds."""
        size, first = self.graphs.batch_sizes[-1], 0
        outs, ids = [], []
        for lo in range(0, len(rows.seqs), size):
            part = slice(lo, lo + size)
            num_rows = sum(rows.counts[part])
            out, drafted = self._draft_part(
                rows._replace(seqs=rows.seqs[part], starts=rows.starts[part],
                              counts=rows.counts[part],
                              hidden=rows.hidden[first: first + num_rows]),
                min(max(num_drafting - lo, 0), size), again=lo > 0)
            outs.append(out)
            ids += drafted
            first += num_rows
        return torch.cat(outs), ids

    def _draft_part(self, rows: MtpRows, num_drafting: int,
                    again: bool) -> tuple[torch.Tensor, list[int]]:
        """One draft graph's replay: the rows' hidden states go where the verify graph of the
        batch's size leaves its own, sequence b's from row b * (k + 1), zeros in the padding
        rows. `again`: a part after the first (`SpecGraphRunner.replay_draft`)."""
        graphs, device = self.graphs, self.runner.device
        full = graphs.rows_per_seq
        host = self._committed_rows(
            rows.seqs, rows.starts, rows.counts,
            max(s + n for s, n in zip(rows.starts, rows.counts, strict=True))
            // self.model.config.index_kpool)
        verify = graphs.verify_graphs[graphs.key(len(rows.seqs), host.num_pools)]
        # NOTE: other graphs of the pool may have used this buffer as working memory since.
        verify.hidden.zero_()
        verify.hidden.index_copy_(0, self._graph_rows(rows.counts), rows.hidden)
        captured = graphs.replay_draft(host, verify, again)
        if not num_drafting:
            return captured.out[:0], []
        picks = upload([b * full + rows.counts[b] - 1 for b in range(num_drafting)], device)
        return captured.out[picks], captured.ids[picks].tolist()

    def _graph_rows(self, counts: list[int]) -> torch.Tensor:
        """The rows of a graph's layout (k + 1 per sequence) that sequences of `counts` rows
        fill, on the device."""
        full = self.graphs.rows_per_seq
        return upload([b * full + j for b, n in enumerate(counts) for j in range(n)],
                      self.runner.device)
