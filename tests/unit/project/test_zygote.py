"""The test zygote (tests/machinery/zygote.py) runs a command as a fresh
``python`` would: its arguments, folder, environment, streams and exit code."""


def test_what_the_imports_printed_every_child_prints_first(tmp_path, monkeypatch, capfd):
    from machinery import zygote_server as module
    (tmp_path / "noisy_module.py").write_text(
        "import os, sys\nprint('said at import')\nprint('warned', file=sys.stderr)\n"
        "os.environ['ZYGOTE_TEST_SET'] = 'by import'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(module, "PRELOAD", ("noisy_module",))
    monkeypatch.delenv("ZYGOTE_TEST_SET", raising=False)
    preloaded = module.Preloaded()
    assert preloaded.printed == [b"said at import\n", b"warned\n"]
    assert preloaded.environ["ZYGOTE_TEST_SET"] == "by import"
    monkeypatch.delenv("ZYGOTE_TEST_SET")
