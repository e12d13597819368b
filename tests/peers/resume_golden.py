"""What both trainer peers (ds_peer.py, mcore_peer.py) do with the trainer's own resumed step:
replay it with torch's AdamW, and write it as expected/resume/ (the golden of
tests/torch/test_trainer_resume.cpp)."""
import json
import os


def adamw_replay_differs(before, grad, after, step, hyper_of):
    """The tensors ("name.kind") where torch's AdamW (foreach=False), stepped once from `before`
    ({name: (weight, exp_avg, exp_avg_sq)}, at `step`) with `grad`, differs from the trainer's
    `after` ({kind: {name: tensor}}, kinds fp32, exp_avg, exp_avg_sq); hyper_of(name) gives the
    group's lr, betas, eps and weight_decay."""
    import torch
    differ = []
    for n in grad:
        w, m, v = before[n]
        q = w.clone().requires_grad_(True)
        o = torch.optim.AdamW([q], **hyper_of(n), foreach=False)
        o.state[q] = {"step": torch.tensor(float(step)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        q.grad = grad[n].clone()
        o.step()
        for kind, got in (("fp32", q.detach()), ("exp_avg", o.state[q]["exp_avg"]),
                          ("exp_avg_sq", o.state[q]["exp_avg_sq"])):
            if not torch.equal(got, after[kind][n]):
                differ.append(f"{n}.{kind}")
    return differ


def write_resume(outdir, grad, after, info):
    """expected/resume/: grad.safetensors, fp32 / exp_avg / exp_avg_sq.safetensors, step.json (info)."""
    import safetensors.torch as st
    sub = os.path.join(outdir, "expected", "resume")
    os.makedirs(sub, exist_ok=True)
    st.save_file(grad, os.path.join(sub, "grad.safetensors"))
    for kind, d in after.items():
        st.save_file(d, os.path.join(sub, f"{kind}.safetensors"))
    with open(os.path.join(sub, "step.json"), "w") as f:
        json.dump(info, f)
