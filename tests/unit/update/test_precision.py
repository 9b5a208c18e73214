"""--bf16 and --fp16: master weights stay fp32, loss scaling is exact, an
overflow skips on every rank, and the scaler state is checkpointed."""


import pytest


from machinery.settings import TOY


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_that_emulates_it_is_named(monkeypatch, caplog, native):
    """An AVX2 CPU emulates bfloat16, 12x slower than fp32 (the GLUE demo):
    a node whose CPU lacks it says so when --bf16 is given; one that has it
    says nothing."""
    from hetseq.app import cli
    from hetseq.update import precision
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: native)
    caplog.set_level("WARNING", logger="hetseq")
    cli.parse([*TOY, "--cpu", "--bf16"])
    assert ("without bfloat16 instructions" in caplog.text) != native, caplog.text
