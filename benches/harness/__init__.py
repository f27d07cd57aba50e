"""The benchmarks' one harness, and asv's benchmark package (``benches/asv.conf.json``).

- ``common``: the settings every run uses, the registry's model, seeded prompts;
- ``cli``: the arguments the scripts share (``--stages``, ``--rounds``, ``--json``);
- ``clusters``: local worker clusters, the same behind link emulators, the seams model;
- ``llama``: the pinned tree's reference programs (llama-bench, RPC, llama-batched-bench,
  llama-server), each mirroring dgr's settings;
- ``measure``: concurrent sessions measured as llama-batched-bench measures its sequences
  (the decode phase's rate, and batched-bench's end-to-end rate);
- ``fresh``: a function of a script or of the harness run in a process of its own;
- ``bench_*``: asv's benchmarks (the long ones run their script through ``fresh``).

Scripts (``python benches/NAME.py``) import the harness; the harness imports no script
(tests/unit/test_imports.py checks it, with no import cycle anywhere in benches/).
"""
