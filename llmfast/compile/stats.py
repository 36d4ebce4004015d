"""What compiling and capturing did: counts, times, cache use; graph memory (the CUDA
graphs' share, `GraphStats`, filled by their capture)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmfast.cuda_graphs.stats import GraphStats


@dataclass
class CompileStats(GraphStats):
    num_dynamo_graphs: int = 0  # graphs the backend compiled; 1 means no recompiles
    precompiled: bool = False  # loaded what a cold start traced: no Dynamo at all
    num_pieces: int = 0  # pieces compiled by Inductor (num_layers + 1 for Llama)
    num_shared_pieces: int = 0  # of those, reusing an identical piece's compiled code
    num_splitting_ops: int = 0  # attention calls left between the pieces
    piece_kinds: list[str] = field(default_factory=list)  # "compiled" / "split", in order
    compile_time_s: float = 0.0
    cache_dir: str | None = None
    cache_hits: int = 0  # FX-graph + AOTAutograd cache hits while compiling
    cache_misses: int = 0

    def record_pieces(self, kinds: list[str], num_shared: int) -> None:
        """The split graph's pieces (`split_graph`'s kinds, in call order)."""
        self.piece_kinds = kinds
        self.num_pieces = kinds.count("compiled")
        self.num_shared_pieces = num_shared
        self.num_splitting_ops = kinds.count("split")

    @property
    def one_graph(self) -> bool:
        """Everything ran on one graph: traced once (or loaded, precompiled), never
        recompiled."""
        return self.num_dynamo_graphs == (0 if self.precompiled else 1)

    def summary(self) -> str:
        how = (f"loaded without tracing in {self.compile_time_s:.1f} s" if self.precompiled
               else f"compiled in {self.compile_time_s:.1f} s")
        line = (
            f"{self.num_pieces} pieces around {self.num_splitting_ops} attention calls "
            f"({self.num_shared_pieces} sharing another's code), {how} "
            f"(cache hits {self.cache_hits}, misses {self.cache_misses})"
        )
        if self.captured_sizes or self.full_graph_sizes:
            line += (
                f"; {self.num_cuda_graphs} piecewise CUDA graphs at "
                f"{len(self.captured_sizes)} sizes, {len(self.full_graph_sizes)} full graphs, "
                f"in {self.capture_time_s:.1f} s, {self.graph_memory_bytes / 2**20:.0f} MiB"
            )
        return line
