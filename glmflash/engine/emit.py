"""How the engine hands a step's tokens to each request: detokenized text with stop strings
applied, logprobs, and the final delta with its counts when a choice ends."""

from __future__ import annotations

import logging

from glmflash.engine.outputs import StreamDelta
from glmflash.engine.scheduler import TokenDelta
from glmflash.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class EngineEmitMixin:
    """`Engine._emit`: per-step deltas to the requests' sinks, on the engine thread."""

    def _emit(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            seq, choice = delta.seq, self._choices[delta.seq.seq_id]
            visible = delta.token_ids
            if delta.finish_reason == "stop":
                # The scheduler stops only on a stop token (eos or stop_token_ids): not text.
                visible = visible[:-1]
            is_last = delta.finish_reason is not None
            text, num_taken = choice.detok.add_run(visible, is_last=is_last)
            reason = delta.finish_reason
            if text.hit_stop_string:
                _drop_after_stop(seq, delta, len(delta.token_ids) - num_taken)
                if reason is None:
                    self.scheduler.finish(seq, "stop")
                reason = "stop"
            if self.spec is not None:
                self.spec.count_output(seq, len(delta.token_ids))
            logprobs = seq.logprobs[-len(delta.token_ids):] if seq.params.logprobs is not None \
                and delta.token_ids else None
            out = StreamDelta(choice.request_id, choice.index, text.text, delta.token_ids, reason,
                              logprobs, seq.num_prompt_tokens, seq.num_output_tokens,
                              num_cached_tokens=seq.num_cached_tokens or 0)
            if seq.prompt_logprobs is not None and seq.num_output_tokens == len(delta.token_ids):
                out.prompt_logprobs = seq.prompt_logprobs
            if reason:
                self._finish(seq, choice, out)
            else:
                self._deliver(seq, choice, out)

    def _finish(self, seq: Sequence, choice, delta: StreamDelta) -> None:
        if self._choices.pop(seq.seq_id, None) is None:
            return
        self.sampler.release(seq)
        self.runner.prompt_logprobs.release(seq)
        self.progress.release(seq)
        with self._lock:
            self.num_pending -= 1
            left = self._live_requests.pop(choice.request_id) - 1
            if left:
                self._live_requests[choice.request_id] = left
        delta.num_prompt_tokens = seq.num_prompt_tokens
        delta.num_output_tokens = seq.num_output_tokens
        delta.num_cached_tokens = seq.num_cached_tokens or 0
        delta.speculative = (seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_verify_steps)
        self._deliver(seq, choice, delta)

    def _deliver(self, seq: Sequence, choice, delta: StreamDelta) -> None:
        """A delta to the request's consumer. A consumer that raises (gone away: a closed event
        loop, a broken callback) ends its own choice, aborted, and nothing else."""
        try:
            choice.sink(delta)
        except Exception:
            logger.warning("the consumer of request %s failed; ending it", choice.request_id,
                           exc_info=True)
            choice.sink = _discard
            if delta.finish_reason is None and self.scheduler.abort(seq.seq_id) is not None:
                self._finish(seq, choice, StreamDelta(choice.request_id, choice.index, "", [],
                                                      "abort"))


def _discard(delta: StreamDelta) -> None:
    """The sink of a choice whose consumer failed."""


def _drop_after_stop(seq: Sequence, delta: TokenDelta, num_dropped: int) -> None:
    """A stop string ended the text before the last of a run's tokens: the tokens after the
    one that completed it are not output (nor their logprobs)."""
    if num_dropped <= 0:
        return
    del delta.token_ids[-num_dropped:]
    del seq.token_ids[-num_dropped:]
    if seq.params.logprobs is not None:
        del seq.logprobs[-num_dropped:]
