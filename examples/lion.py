"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), as your own optimizer:

    torchrun --nproc-per-node=8 train.py ... --optimizer examples/lion.py:Lion \
        --optimizer-args '{"betas": [0.9, 0.99]}' --learning-rate 1e-6 --weight-decay 0.1

Elementwise, so it steps FSDP2's shards as they are; its one state is shaped like the parameter, so the full state
saves and resumes it.
"""

import torch


class Lion(torch.optim.Optimizer):
    state_bytes_per_param = 4.0  # one fp32 momentum; tells the memory plan what this keeps

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                momentum = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(momentum.lerp(p.grad, 1 - beta1)), alpha=-group["lr"])
                momentum.lerp_(p.grad, 1 - beta2)
