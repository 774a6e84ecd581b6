"""Entry points through which serving engines load this backend.

- `dsv4.plugins.sglang:register`, entry point `dsv4_rocm` in `sglang.srt.plugins`;
- `dsv4.plugins.vllm:register`, entry point `dsv4_rocm` in `vllm.general_plugins`.

Only this package imports a serving engine, and only inside the functions its loader calls.
`python -m dsv4 env` prints what each plugin would replace in the installed engines.
"""
