"""Regeneration with :class:`dspark.data.fast_decode.ContinuousDecoder`: the CPU default engine.

Same contract as :class:`dspark.data.hf_generator.HFGenerator` (the chat rendering, end tokens and answer
decoding are that module's functions), with per-request seeds like the vLLM and OpenAI generators
(``prompt_seed(seed, conversation)``: a record's answer does not depend on its batch). One ``generate`` call
decodes all its prompts with ``slots`` rows in flight; ``stream`` keeps the rows full across records and turns
(the regeneration loop's streaming path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from dspark.data.fast_decode import ContinuousDecoder, DecodeRequest
from dspark.data.generator import BatchPartialFailure, Completion, GenerationError, Message, SamplingParams, prompt_seed
from dspark.data.hf_generator import NON_THINKING, decode_answer, render_chat, stop_token_ids



class NativeGenerator:
    """A transformers causal LM (of a type fast_decode supports) decoded by the continuous-batching engine."""

    def __init__(self, model, tokenizer, sampling: SamplingParams, *, slots: int, max_model_len: int,
                 chat_template_kwargs: dict | None = None, name: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target's tokenizer has no chat template (tokenizer.chat_template is empty): "
                             "regeneration renders conversations with it; add one to tokenizer_config.json")
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.chat_template_kwargs = dict(NON_THINKING) if chat_template_kwargs is None else chat_template_kwargs
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.stop_ids = stop_token_ids(eos, tokenizer)
        self._stop = set(self.stop_ids)
        self.slots, self.max_model_len = slots, max_model_len
        self.model = model.eval()
        self._decoders: dict[tuple[float, float], ContinuousDecoder] = {}
        self.name = name or f"native:{getattr(model.config, '_name_or_path', '') or type(model).__name__}"

    def _decoder(self, sampling: SamplingParams) -> ContinuousDecoder:
        key = (sampling.temperature, sampling.request_top_p)
        if key not in self._decoders:
            self._decoders.clear()  # one KV cache at a time
            self._decoders[key] = ContinuousDecoder(self.model, slots=self.slots, max_len=self.max_model_len,
                                                    stop_ids=self.stop_ids, temperature=key[0], top_p=key[1])
        return self._decoders[key]

    def _request(self, messages: Sequence[Message], sampling: SamplingParams) -> DecodeRequest:
        ids = self.tokenizer(render_chat(self.tokenizer, messages, self.chat_template_kwargs),
                             add_special_tokens=False)["input_ids"]
        return DecodeRequest(ids, sampling.max_new_tokens, prompt_seed(sampling.seed, messages))

    def _completion(self, out) -> Completion | Exception:
        if isinstance(out, Exception):
            return GenerationError(str(out))
        return decode_answer(self.tokenizer, out.token_ids, self._stop, out.finish_reason)

    def stream(self, next_prompt: Callable[[], tuple[object, Sequence[Message]] | None],
               sampling: SamplingParams | None = None) -> Iterator[tuple[object, Completion | Exception]]:
        """Answers as they finish: ``next_prompt()`` hands out ``(key, conversation)`` (None: nothing now) each
        time a row frees; yields ``(key, Completion or the row's exception)``."""
        sampling = sampling or self.sampling

        def next_request():
            item = next_prompt()
            return None if item is None else (item[0], self._request(item[1], sampling))

        for key, out in self._decoder(sampling).serve(next_request):
            yield key, self._completion(out)

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[Completion]:
        """One answer per conversation (the batch protocol of dspark.data.generator)."""
        sampling = sampling or self.sampling
        outs = self._decoder(sampling).run([self._request(m, sampling) for m in batch])
        results = [self._completion(out) for out in outs]
        if any(isinstance(r, Exception) for r in results):
            raise BatchPartialFailure(results)
        return results
