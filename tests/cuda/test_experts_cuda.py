"""Expert LoRA on CUDA through a whole MoE model: the Triton kernels over the expert slot buffers against the torch
reference on the same device, in one co-batched pass of runs of mixed ranks with dropout (Qwen3-MoE's and GPT-OSS's
experts modules, the latter transposed with biases). An fp32 base, references with TF32 off: within 1e-5 of each
tensor's scale, as test_lora_ops_cuda.py's fp32 checks; the kernels alone in bf16 are test_lora_ops_cuda.py's."""

from __future__ import annotations

import pytest

from tests.cuda.cuda_tools import compiled_triton, requires_cuda  # noqa: F401 - the fixture, used by name
from tests.gpu_runtime.test_expert_slots import assert_near, co_batched_pass

pytestmark = [requires_cuda, pytest.mark.usefixtures("compiled_triton")]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_triton_expert_lora_equals_the_reference_in_a_moe_pass(family: str) -> None:
    got, expected = co_batched_pass(family, "cuda", "triton"), co_batched_pass(family, "cuda", "torch")
    assert len(got) == len(expected) > 1
    for g, e in zip(got, expected):
        assert_near(g.float().cpu(), e.float().cpu())
