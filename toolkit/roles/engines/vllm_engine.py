"""vLLM engine: one in-process `vllm.LLM` per generator worker, weights reloaded in place."""

from __future__ import annotations

import logging
import os

import torch

from toolkit.roles.engines import Completion

log = logging.getLogger(__name__)

EXTENSION = "toolkit.weights.vllm_extension.WeightSyncExtension"
RPC_MARGIN_S = 30.0  # beyond the timeout of the collectives in a call into the engine's ranks (theirs names the peer)


def cpu_binding(ranks: int, cpus: list[int], group: str = "generator") -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `ranks` tensor-parallel ranks on `cpus`: as many CPUs for each,
    in order ("0,1|2,3"); a CPU left over stays unbound, for the engine's own process."""
    if len(cpus) < ranks:
        raise RuntimeError(
            f"rollout.vllm.tensor_parallel_size is {ranks}, but this generator worker may use {len(cpus)} CPU(s) "
            f"({', '.join(map(str, cpus))}); on CPUs every tensor-parallel rank needs one of its own: give "
            f"placement.{group}.cpus_per_worker at least {ranks}, or lower the size")
    share = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[r * share:(r + 1) * share])) for r in range(ranks))


def eager_helpers_on_cpu() -> None:
    """On CPU, with enforce_eager, vLLM still compiles a few small helpers with torch.compile when they are
    first called (the rank of each sampled token among the log-probs; with tensor parallelism, the vocabulary
    mask): a C++ build of about 3.5 s in every process that starts an engine, before its first sample, for
    integer kernels that take microseconds here. Run them eagerly instead: the same numbers (the compiled
    form exists to save GPU memory). The environment carries it to vLLM's tensor-parallel rank processes;
    TORCH_COMPILE_DISABLE=0 set by the user keeps compiling."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.setdefault("TORCH_COMPILE_DISABLE", "1") == "1":
        import torch._dynamo

        torch._dynamo.config.disable = True


def whole_prefills_on_cpu(platform, max_model_len: int, ranks: int) -> dict:
    """On CPU, vLLM's engine arguments that prefill every prompt in one engine step. With chunked prefill
    (vLLM's default), a step whose prompts hold more tokens than an engine step takes
    (max_num_batched_tokens, 4096 per rank on CPU) prefills a prompt in parts; the token sampled after a
    part is thrown away and vLLM rewinds the request's seeded generator (`set_offset`), which a CPU
    generator does not have: the generator failed with "CPU Generator does not use offset" (e.g. 32
    prompts x 8 samples of 15-token prompts, `init`'s starter config). Without chunking, prompts that do
    not fit wait for the next engine step instead, and each sample is the same (its own seed). On GPUs the
    defaults stay."""
    if not platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096 * ranks, max_model_len)}


class VllmEngine:
    def __init__(self, cfg, device, beside_trainer: bool = False):
        """`beside_trainer`: in a trainer rank's process (Flattening, an engine per rank): the trainer loads its
        weights with `load_local`, and where vLLM can sleep (GPU) it sleeps while the trainer works."""
        # The engine core runs in this process: one vLLM import instead of three, and no orphans.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        # (vllm-cpu has no sleep mode: there the same calls are skipped)
        self.sleeps = beside_trainer and current_platform.is_sleep_mode_available()
        self.asleep = False
        self.stream_calls = 0  # (request ids of `stream` are unique per call)

        vcfg = cfg.rollout.vllm
        self.cfg = cfg
        # (a call into the engine's ranks: their collectives time out at step_timeout_s, a rank that hangs or
        # died is caught here; one rank runs in this process, where vLLM has nothing to time out)
        self.rpc_timeout_s = cfg.transport.step_timeout_s + RPC_MARGIN_S
        self.ranks = vcfg.tensor_parallel_size
        if self.ranks > 1 and current_platform.is_cuda_alike():
            # The worker has asked torch whether it has a GPU (Role.device), after which a process forked
            # from it cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess"); vLLM forks its
            # ranks unless it sees CUDA initialised. They start as fresh interpreters instead (as on CPUs, where
            # vLLM's platform code spawns them whatever this says: the CPU runs go through the same start).
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if self.ranks > 1 and current_platform.is_cpu():
            # vLLM binds each rank's threads to a NUMA node of its own, and fails where there are fewer
            # nodes than ranks (one, on most nodes): give each rank its share of this worker's CPUs instead.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(
                self.ranks, sorted(os.sched_getaffinity(0)), cfg.placement.name_with("generation")))
        if vcfg.enforce_eager:
            eager_helpers_on_cpu()
        max_model_len = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
        self.llm = LLM(
            model=cfg.model.actor,
            tokenizer=str(cfg.tokenizer_path),
            dtype=cfg.model.dtype,
            seed=cfg.run.seed,
            max_model_len=max_model_len,
            tensor_parallel_size=vcfg.tensor_parallel_size,
            distributed_executor_backend="uni" if vcfg.tensor_parallel_size == 1 else "mp",
            enforce_eager=vcfg.enforce_eager,
            kv_cache_memory_bytes=int(vcfg.kv_cache_gb * 2**30),
            # Log-probs of the distribution actually sampled from (after temperature/top-p).
            logprobs_mode="processed_logprobs",
            # The prefix cache makes results depend on what ran before; deterministic runs go without it.
            enable_prefix_caching=not cfg.run.deterministic,
            max_logprobs=-1,  # prompt_logprobs(top=-1) may ask for the whole vocabulary (checks)
            worker_extension_cls=EXTENSION,
            enable_sleep_mode=self.sleeps,
            **whole_prefills_on_cpu(current_platform, max_model_len, vcfg.tensor_parallel_size),
        )
        if self.ranks > 1:  # (the method vLLM took, read once its ranks run: its platform code may set it)
            from toolkit.tmpdir import note_file_stores

            note_file_stores()  # (the ranks' files in /dev/shm are named after their file store: removed at the end)
            log.info("vLLM's %d tensor-parallel ranks started by %s (VLLM_WORKER_MULTIPROC_METHOD)", self.ranks,
                     os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"))

    def _params(self, seeds: list[int], sampling=None) -> list:
        """vLLM's sampling parameters of each sample: the rollout's, or `sampling`'s (an evaluation's:
        temperature 0 is greedy; responses end at the end-of-sequence token)."""
        from vllm import SamplingParams

        r = self.cfg.rollout
        s = sampling or r
        return [SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=r.max_new_tokens,
                               logprobs=0, seed=seed, ignore_eos=r.ignore_eos and sampling is None) for seed in seeds]

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling=None) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self._params(seeds, sampling),
                                    use_tqdm=False)
        return [_completion(out) for out in outputs]

    def stream(self, prompts: list[list[int]], seeds: list[int]):
        """The same samples as `generate`, in the order they finish: after each step of the engine's loop
        (what `LLM.generate` runs), the (index in `prompts`, Completion) pairs of the samples it finished."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self.stream_calls += 1
        index, added = {}, []  # (our request ids: their positions; the engine's own ids, to abort them)
        try:
            for i, (tokens, params) in enumerate(zip(prompts, self._params(seeds))):
                params.output_kind = RequestOutputKind.FINAL_ONLY
                index[f"rl{self.stream_calls}-{i}"] = i
                added.append(engine.add_request(f"rl{self.stream_calls}-{i}", TokensPrompt(prompt_token_ids=tokens), params))
            while engine.has_unfinished_requests():
                finished = [(index[out.request_id], _completion(out)) for out in engine.step() if out.finished]
                if finished:
                    yield finished
        finally:  # (a consumer that stops early, or an error: no request stays in the engine)
            if engine.has_unfinished_requests():
                engine.abort_request(added, internal=True)

    def prompt_logprobs(self, tokens: list[int], top: int = 0) -> list[dict[int, float]]:
        """For each token after the first: {token id: log-prob} of that token and the `top` likeliest ones
        (`top=-1`: every token of the vocabulary)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                                SamplingParams(max_tokens=1, prompt_logprobs=top), use_tqdm=False)[0]
        return [{t: lp.logprob for t, lp in step.items()} for step in out.prompt_logprobs[1:]]

    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                         name: str = "0") -> dict:
        """Join the trainer's weight-sync group `name` (every vLLM worker of this engine); {weights, probe}."""
        return self.llm.collective_rpc("join_weight_sync", args=(host, port, first_rank, world_size, timeout_s, name),
                                       timeout=timeout_s + RPC_MARGIN_S)[0]

    def receive_weights(self) -> tuple[int, torch.Tensor]:
        """Load the next version of the weights; (that version, the trainer's probe log-probs)."""
        version, expected = self.llm.collective_rpc("receive_weights", timeout=self.rpc_timeout_s)[0]
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        return version, torch.tensor(expected, dtype=torch.float32)

    def load_local(self, named_tensors) -> None:
        """Load (name, tensor) pairs of the checkpoint layout from this process's trainer, in memory."""
        if self.asleep:  # the weights first; the KV cache after they are in place
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("load_local", args=(list(named_tensors),), timeout=self.rpc_timeout_s)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Give back the KV cache and the weights (the trainer's update replaces them) until `load_local`."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        self.llm = None


def _completion(out) -> Completion:
    """A finished vLLM RequestOutput of one sample, with the log-prob of each sampled token."""
    c = out.outputs[0]
    tokens = list(c.token_ids)
    return Completion(tokens, [step[t].logprob for t, step in zip(tokens, c.logprobs)], c.finish_reason == "stop",
                      c.text)
