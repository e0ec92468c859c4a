"""The real request traces: where each comes from, under which licence, where it is looked for,
and the generated workload that stands in for it (issue 27).

They are not in the repository (their licences are their own, and they are megabytes): on this
project's machines they sit in ``../shared/data`` beside the checkout (`SHARED_DATA_DIR`), each
folder with a README giving its source, commit, licence and SHA-256
(``shared/data/traces/README.md``, ``shared/data/conversations/README.md``); elsewhere a user
copies them there from the sources below, or passes a file to the tools (``--trace PATH``), or
uses the generated workloads, which every command defaults to. The README's "Real traces" lists
the same sources (tests/test_without_real_traces.py checks it against `REAL_TRACES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SHARED_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
"""``../shared/data`` beside the repository (where the real traces live on this project's machines)."""


@dataclass(frozen=True, slots=True)
class RealTrace:
    """One real data file: its place under `SHARED_DATA_DIR` and where it comes from."""

    relative: Path
    """Its path under `SHARED_DATA_DIR`."""
    repository: str
    """The public repository it is an unmodified copy from."""
    source_path: str
    """Its path in that repository."""
    licence: str
    """The licence it is under (SPDX id), with any attribution it asks for."""
    stand_in: str
    """The generated workload (`sim.workloads.WORKLOADS`) to use without it, or "" (test data only)."""


MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"  # shared/data/traces/README.md's snapshot
AZURE_COMMIT = "b469a113cedca53ddc3bdea71a143dc4b7d8700c"
FASTCHAT_COMMIT = "0e6d3e4beaab66f4d3f93db72541a4abab8af28d"
AZURE_ATTRIBUTION = "CC-BY-4.0 (attribution: Patel et al., Splitwise, ISCA 2024)"

REAL_TRACES: dict[str, RealTrace] = {
    "mooncake": RealTrace(Path("traces/mooncake/conversation_trace.jsonl"), "https://github.com/kvcache-ai/Mooncake",
                          "FAST25-release/traces/conversation_trace.jsonl", "Apache-2.0", "mooncake-like"),
    "azure-conv": RealTrace(Path("traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"),
                            "https://github.com/Azure/AzurePublicDataset", "data/AzureLLMInferenceTrace_conv.csv",
                            AZURE_ATTRIBUTION, "chat"),
    "azure-code": RealTrace(Path("traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"),
                            "https://github.com/Azure/AzurePublicDataset", "data/AzureLLMInferenceTrace_code.csv",
                            AZURE_ATTRIBUTION, "agentic-coding"),
    "sharegpt-fastchat": RealTrace(Path("conversations/fastchat/dummy_conversation.json"),
                                   "https://github.com/lm-sys/FastChat", "data/dummy_conversation.json",
                                   "Apache-2.0", ""),
}
"""Every real data file a workload, a test or a bench script reads, by name."""


def real_trace_path(name: str) -> Path:
    """Where the real trace ``name`` (a key of `REAL_TRACES`) is looked for, present or not."""
    return SHARED_DATA_DIR / REAL_TRACES[name].relative


def missing_message(name: str) -> str:
    """Why the real trace ``name`` is absent and what to do: where to get it (repository, path,
    licence), where to put it, and the generated stand-in."""
    trace = REAL_TRACES[name]
    instead = f"; or use the generated stand-in, --workload {trace.stand_in}" if trace.stand_in else ""
    return (f"real trace {name!r} not found at {real_trace_path(name)}: the real traces are not in the repository. "
            f"Get {trace.source_path} from {trace.repository} ({trace.licence}) and put it there, or pass the "
            f"file with --trace PATH (README, \"Real traces\"){instead}")


def require_real_trace(name: str) -> Path:
    """The path of the real trace ``name``.

    Raises:
        FileNotFoundError: it is absent; the message is `missing_message`.
    """
    path = real_trace_path(name)
    if not path.is_file():
        raise FileNotFoundError(missing_message(name))
    return path
