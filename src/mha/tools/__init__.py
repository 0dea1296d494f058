"""The tools around the core, one module per ``mha`` command (the CLI only parses arguments).

    verify          mha verify: mha against torch and the float64 oracle over a grid of configurations
    bench           mha bench: speed and memory as ratios against torch in one run
    bench_memory    its worker: one default path's peak memory, in a fresh process (python -m)
    bench_variants  its worker: one efficient variant's time, memory and error (python -m)
    explain         mha explain: the computation step by step, with the shapes
    plot            mha plot: attention maps (an example sentence, or a BERT checkpoint's)
    bert            the small BERT encoder that mha plot runs
    convert         mha convert: weights files from one layout to another

They use rich, matplotlib and safetensors; the core (import mha) needs none of them.
"""
