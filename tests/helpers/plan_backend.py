"""Run `attention_plan` on its Triton kernel wherever the kernel takes the step (decode plans),
and on the torch body elsewhere (extend plans), recording which ran."""

import importlib

plan_module = importlib.import_module("hip_kernels.attention_plan")


def plans_on_triton(monkeypatch) -> set:
    """Patch the plan's backend choice for this test; returns the set of backends that ran."""
    ran, real_op = set(), plan_module.op

    def recorded_op(name, backend):
        ran.add(backend)
        return real_op(name, backend)

    monkeypatch.setattr(plan_module, "resolve",
                        lambda op, device, backend, triton_ok=True: "triton" if triton_ok
                        else "torch")
    monkeypatch.setattr(plan_module, "op", recorded_op)
    return ran
