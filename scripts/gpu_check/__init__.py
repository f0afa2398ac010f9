"""The GPU check: kvfork's release wheel on a CUDA machine with no Rust and no network.

`prepare.sh` (here) gathers the inputs into `.gpu-check/` and plans the device calls; on the
GPU machine `run_stage.sh STAGE` receives them, builds llama.cpp's CUDA module, installs the
wheel with it, runs the test suite and the benchmarks. CONTRIBUTING.md ("Running the GPU
check") has the steps. The Python helpers use the standard library only: on the GPU machine
they run before anything is installed.
"""
