"""hetseq-launch: a whole job started from one command (a hostfile, SSH);
``python -m hetseq.launch.node`` and ``.probe`` are what remote hosts run.
The modules: docs/design.md's map; how to use it: docs/nodes.md.
Layer 16, the top: imports app and the layers below.
Tests: tests/unit/launch/, tests/system/."""
