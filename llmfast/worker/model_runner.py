"""`ModelRunner`: load -> measure memory -> allocate the KV cache -> compile -> capture
-> `execute()` one scheduler step at a time.

The runner keeps its own per-request state, so each step applies only the
SchedulerOutput's increments, then prepares inputs with vectorised numpy into
persistent buffers and copies each to the device once.

`execute_async` launches a step and returns at once with a `PendingStep`; `collect`
reads its sampled ids later (`execute` does both). Nothing between them waits for the
device: the sampled ids stay there, and the next step's input ids (and penalty token ids)
take a row's not-yet-known last token from them by a device-side gather/scatter, so the
host can prepare step N+1 while the device still runs step N.

The runner coordinates; each idea lives in its own module: state_updates.py (apply the
SchedulerOutput), step_inputs.py (the persistent input buffers and their filling),
placeholders.py (not-yet-known sampled tokens), sampling/prompt_logprobs.py (the prompt
tokens' logprobs, for the requests that ask), startup/ (the Triton precompile, memory
profile, compile and capture, the KV cache's size and allocation; their order:
startup/runner_startup.py, a base of the runner), step_output.py (the sampled ids' copy to
the host).
"""

from __future__ import annotations

import logging
import time

import torch

from llmfast.compile import CompiledModel, CompileStats
from llmfast.config import EngineConfig, kv_cache_torch_dtype
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmfast.distributed import TensorParallelGroup
from llmfast.cuda_graphs.dispatch import RunnerKind
from llmfast.cuda_graphs.model_graphs import ModelCudaGraphs
from llmfast.kernels.cpu.linear import prepack_budget_bytes, prepack_linears
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import ModelSource
from llmfast.profiling.nvtx_ranges import nvtx_range
from llmfast.utils.progress import Progress
from llmfast.worker.input_batch import CachedRequestState, InputBatch
from llmfast.worker.placeholders import PlaceholderFill, record_placeholders, write_sampled_tokens
from llmfast.worker.sampling.grammar_bitmask import GrammarBitmask, wants_grammar
from llmfast.worker.sampling.prompt_logprobs import (
    PromptLogprobsPlan,
    PromptLogprobsStaging,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from llmfast.worker.sampling.sampler import Sampler
from llmfast.worker.sampling.sampling_metadata import SamplingStaging, build_sampling_metadata
from llmfast.worker.sampling.tp_sampling import sample_on_first_rank
from llmfast.worker.spec_decode.spec_decoder import SpecDecoder, TargetFacts, make_proposer
from llmfast.worker.startup.graph_capture import CaptureInputs
from llmfast.worker.startup.runner_startup import RunnerStartup
from llmfast.worker.state_updates import update_states
from llmfast.worker.step_inputs import StepInputs
from llmfast.worker.step_output import OutputCopier, PendingStep

logger = logging.getLogger(__name__)


class ModelRunner(RunnerStartup):
    def __init__(self, config: EngineConfig, source: ModelSource,
                 eos_token_ids: tuple[int, ...] = (), progress: Progress | None = None,
                 tp_group: TensorParallelGroup | None = None) -> None:
        self.config = config
        # This rank's place in tensor parallelism (one rank: no communication).
        self.tp_group = tp_group or TensorParallelGroup.single()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches, CUDA events and streams use the *current* device: with
            # --device cuda:1 they would otherwise go to cuda:0 (TP ranks set it too).
            torch.cuda.set_device(self.device)
        self.dtype = config.torch_dtype
        # The KV cache's element type: the model's, or float8_e4m3fn (--kv-cache-dtype
        # fp8); the kernels convert on write and read (attention/triton/kernels.py).
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.eos_token_ids = eos_token_ids
        sched = config.scheduler
        self.max_num_tokens = sched.max_num_batched_tokens
        self.max_num_reqs = sched.max_num_seqs
        self.max_model_len = sched.max_model_len
        self.block_size = config.cache.block_size
        self.startup_times: dict[str, float] = {}

        t0 = time.perf_counter()
        self.model = build_model(source, self.dtype, self.device,
                                 max_positions=self.max_model_len, seed=config.seed,
                                 progress=progress, tp=self.tp_group,
                                 quantization=config.quantization)
        if self.device.type == "cpu" and config.compile.enforce_eager:
            # A second, blocked copy of the weights: at most a quarter of the RAM.
            prepack_linears(self.model, prepack_budget_bytes())
        self.startup_times["load"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.vocab_size = source.config.vocab_size

        # The persistent buffers the model reads (filled by StepInputs.prepare), also by
        # name: tests and scripts read them as the runner's.
        self.inputs = StepInputs(self.max_num_tokens, self.max_num_reqs, self.device)
        self.input_ids, self.positions = self.inputs.input_ids, self.inputs.positions
        self.query_start_loc, self.seq_lens = self.inputs.query_start_loc, self.inputs.seq_lens
        self.logits_indices = self.inputs.logits_indices
        # Async scheduling: the last step's sampled ids, gathered into the next inputs.
        self.placeholders = PlaceholderFill(self.max_num_reqs, self.device)
        self.sampling_staging = SamplingStaging(self.device)
        self.prompt_logprobs_staging = PromptLogprobsStaging(self.device)
        # Speculative decoding: drafts in, the verify step's rejection sampling, the
        # proposer after each step (spec_decode/spec_decoder.py); None when off.
        self.spec = None
        if config.speculative is not None:
            proposer = make_proposer(config.speculative, TargetFacts(
                self.vocab_size, self.dtype, self.kv_dtype, self.device, self.max_model_len,
                config.seed))
            self.spec = SpecDecoder(config.speculative, self.max_num_reqs,
                                    self.max_num_tokens, self.device, proposer)
        self.output_copier = OutputCopier(
            self.max_num_reqs, self.device,
            1 if self.spec is None else config.speculative.num_speculative_tokens + 2)
        # CUDA: recorded after a step's host-to-device copies; the next step waits on it
        # before rewriting the pinned buffers those copies read (in steady state they
        # finished long ago: they ran before the previous forward).
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._inputs_copy_queued = False
        self.phase_timer = None  # a PhaseTimer while profiling (LLMEngine.set_phase_timer)

        self.requests: dict[str, CachedRequestState] = {}
        # The layers' KV-cache groups (core/kv_cache_groups.py): a block table each.
        self.kv_groups = self.model.kv_groups
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len,
                                      self.max_num_tokens, self.block_size, self.device,
                                      self.kv_groups.num_groups)
        self.sampler = Sampler()
        # Structured outputs' matchers and bitmask; the last launched step, whose sampled
        # ids a matcher may need before it is collected (grammar_bitmask.py).
        self._source = source
        self.grammar: GrammarBitmask | None = None
        self._last_step: PendingStep | None = None
        # The CUDA graphs (none under enforce_eager or on the CPU), and the compiled model
        # whose pieces they wrap: eager passthrough under enforce_eager, else the
        # piecewise compile. One stats object: what compiling and capturing did.
        stats = CompileStats()
        self.cuda_graphs = ModelCudaGraphs(
            config.compile, self.device, self.max_num_tokens, max_num_reqs=self.max_num_reqs,
            graph_impl="emulated" if config.compile.emulate_cuda_graphs else "auto",
            stats=stats,
            # Verify steps of 1 + K tokens a request get full graphs of their own.
            spec_query_len=0 if config.speculative is None
            else 1 + config.speculative.num_speculative_tokens)
        self.compiled = CompiledModel(
            self.model, config.compile, self.device, graphs=self.cuda_graphs, stats=stats,
            # Not under tensor parallelism: every rank would have to load alike, and
            # the saving start's check runs a forward (collectives) on one rank's say.
            precompile=self.tp_group.world_size == 1)
        self.forward_fn = self.compiled
        self.capture_inputs = CaptureInputs(self.inputs, self.input_batch, self.model,
                                            self.compiled)
        self.num_blocks = 0
        # {"precompiled": n, "compiled_at_launch": m} once a start-up precompiled its
        # Triton variants (initialize), with "precompile_failed": 1 where that raised (the
        # launches compiled them then); None where it did not try.
        self.triton_variants: dict[str, int] | None = None
        # The persistent buffers, and the compiler's set-up (its imports: Dynamo, and
        # Inductor for the layers' triton ops).
        self.startup_times["setup"] = time.perf_counter() - t0

    def _full_inputs(self, size: int, query_len: int = 1) -> list[torch.Tensor]:
        """What a full graph of `size` reads (the persistent buffers, the KV caches)."""
        return self.capture_inputs.full_inputs(size, query_len)

    # ------------------------------------------------------------------ per step

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        """The token count the step runs at (CUDA-graph sizes pad; eager does not)."""
        return self.cuda_graphs.padded_num_tokens(num_tokens, uniform_decode)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids (the synchronous loop)."""
        pending = self.execute_async(out)
        if pending is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.collect(pending)

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> PendingStep | None:
        """Apply `out`, launch its forward and sampler, queue the copy of the sampled ids
        to the host; None if nothing was scheduled. Never waits for the device, except
        (CUDA) for the previous step's input copies, before rewriting their sources."""
        with nvtx_range("prepare_inputs", self.phase_timer):
            if self._inputs_copy_queued:
                self._inputs_copied.synchronize()
                self._inputs_copy_queued = False
            update_states(self.requests, self.input_batch, out)
            num_draft_total = self.spec.write_drafts(out, self.input_batch) if self.spec else 0
            grammar = self._update_grammars(out)
            batch = self.input_batch
            n = batch.num_reqs
            if out.total_num_scheduled_tokens == 0 or n == 0:
                return None
            md, dispatch, num_sched, sampling_rows = self.inputs.prepare(
                out, batch, self.cuda_graphs.dispatcher, self.placeholders)
            num_padded = dispatch.descriptor.num_tokens
            metadata = build_sampling_metadata(batch, n, self.vocab_size, self.eos_token_ids,
                                               self.sampling_staging,
                                               self.placeholders.prev_sampled)
            # Before the copies' event: its staging buffers are inputs too.
            prompt_plan = plan_prompt_logprobs(batch, num_sched, self.prompt_logprobs_staging)
            grammar_plan = grammar and grammar.plan(batch, n, sampling_rows)
            if self._inputs_copied is not None:
                self._inputs_copied.record()
                self._inputs_copy_queued = True
            step = record_placeholders(batch, self.requests, num_sched, sampling_rows,
                                       metadata.max_num_logprobs is not None)
        if dispatch.runner is RunnerKind.FULL:
            # One token per row, in row order: the graph's logits rows are the rows'
            # (a verify step: q = 1 + K tokens per row, its logits rows the tokens').
            # The graph's inputs are listed only for the debug check: ~50 us of module
            # attribute reads per step for a 16-layer model.
            q = max(dispatch.descriptor.query_len, 1)
            inputs = (self._full_inputs(num_padded, q)
                      if self.cuda_graphs.checks_static_addresses else ())
            with nvtx_range(f"forward[{num_padded} full graph]", self.phase_timer):
                logits = self.cuda_graphs.replay_full(dispatch.descriptor.graph_key,
                                                      inputs)[:n * q]
            hidden = None
        else:
            with nvtx_range(f"forward[{num_padded}]", self.phase_timer):
                hidden = self.forward_fn(
                    self.input_ids.gpu[:num_padded], self.positions.gpu[:num_padded], md)
            logits = None
        if grammar_plan:  # on the host while the device runs the forward
            with nvtx_range("grammar_bitmask", self.phase_timer):
                last = self._last_step
                metadata.grammar_bitmask = grammar.fill(
                    grammar_plan, last.wait() if last is not None and max(
                        grammar_plan.pending_src) >= 0 else None)
        if num_draft_total:
            # A verify step: logits of every draft position and each request's last one,
            # rejection-sampled. Under a full graph (every request verifying K drafts)
            # those rows are all the step's tokens, in order: the graph's logits.
            with nvtx_range("verify", self.phase_timer):
                rows = self.spec.logits_rows(num_sched, num_draft_total)
                target_logits = (logits if logits is not None
                                 else self.model.compute_logits(hidden[rows]))
                sampled, sampled_logprobs = self.spec.verify(
                    target_logits, metadata, n, num_draft_total)
                # [n, K + 2]; the synchronous loop only (no placeholder reads it).
                self.placeholders.prev_sampled = sampled
                step["spec_width"] = sampled.shape[1]
        else:
            with nvtx_range("sample", self.phase_timer):
                if logits is None:
                    logits = self.model.compute_logits(hidden[self.logits_indices.gpu[:n]])
                sampler_out = (self.sampler(logits, metadata) if self.tp_group.world_size == 1
                               else sample_on_first_rank(self.sampler, logits, metadata,
                                                         self.tp_group))
                sampled = sampler_out.sampled_token_ids  # [n], stays on the device
                sampled_logprobs = sampler_out.logprobs
                self.placeholders.prev_sampled = sampled
        prompt_logprobs = None
        if prompt_plan is not None:
            with nvtx_range("prompt_logprobs", self.phase_timer):
                prompt_logprobs = self._prompt_logprobs(prompt_plan, hidden, logits,
                                                        dispatch.runner)
            step["prompt_spans"] = prompt_plan.spans
        if self.spec is not None and self.spec.needs_step_tensors:
            step["spec_step"] = self.spec.step_tensors(self.inputs, batch, md,
                                                       int(num_sched.sum()), sampled,
                                                       sampling_rows)
            if not metadata.all_greedy:
                step["spec_sampling"] = metadata
        step.update(self.output_copier.copy(sampled, sampled_logprobs, prompt_logprobs))
        pending = PendingStep(sampled_device=sampled, **step)
        if grammar is not None:
            self._last_step = pending
        return pending

    def _update_grammars(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """Structured outputs' state after `out`; None until a request has a constraint,
        and on ranks that do not sample (grammar_bitmask.py)."""
        if self.grammar is None and self.tp_group.is_first_rank and wants_grammar(out):
            self.grammar = GrammarBitmask.for_model(self._source, self.eos_token_ids,
                                                    self.max_num_reqs, self.device)
        if self.grammar is not None:
            self.grammar.update(out)
        return self.grammar

    def _prompt_logprobs(self, plan: PromptLogprobsPlan, hidden: torch.Tensor | None,
                         logits: torch.Tensor, runner: RunnerKind) -> torch.Tensor:
        """The packed prompt logprobs of `plan`'s rows (sampling/prompt_logprobs.py)."""
        if runner is RunnerKind.FULL:
            # One token per row: the graph's logits rows are the step's token rows.
            def logits_of(rows: torch.Tensor) -> torch.Tensor:
                return logits[rows]
        else:
            def logits_of(rows: torch.Tensor) -> torch.Tensor:
                return self.model.compute_logits(hidden[rows])
        # Slices of max_num_seqs rows: the [rows, vocab] temporaries stay the size of the
        # sampler's, which the start-up memory profile made room for.
        return compute_prompt_logprobs(logits_of, plan, self.max_num_reqs)

    def collect(self, step: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled ids; write them into the batch rows that
        still hold their placeholders; return them per scheduled request."""
        sampled_np = step.wait()
        if step.spec_width:
            return self.spec.collect_verify(step, sampled_np, self.input_batch)
        write_sampled_tokens(step, sampled_np, self.requests, self.input_batch)
        if self.placeholders.prev_sampled is step.sampled_device:
            # No step launched since this one (the synchronous loop): the host rows now
            # hold every sampled value, so the next step has no placeholder to fill or
            # gather on the device.
            self.input_batch.pending_src[:] = -1
        sampled = sampled_np.tolist()
        if len(step.rows) == len(sampled) and not step.samples.count(False):
            # A decode step: every row ran and sampled, rows 0..n-1 in order.
            tokens = [[t] for t in sampled]
        else:
            tokens = [[sampled[r]] if s else [] for r, s in zip(step.rows, step.samples)]
        logprobs = None
        if step.logprobs_host is not None:
            logprobs = step.collect_logprobs()
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=tokens,
                                 logprobs=logprobs,
                                 prompt_logprobs=step.collect_prompt_logprobs(),
                                 spec_token_ids=None if self.spec is None
                                 else self.spec.propose_for(step, self.input_batch))
