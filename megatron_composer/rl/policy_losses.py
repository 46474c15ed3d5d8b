"""placeholder"""
POLICY_LOSSES = {"dr_grpo": None, "ppo_clip": None, "decoupled_ppo": None}


def get_policy_loss(name):
    if name not in POLICY_LOSSES:
        raise ValueError(f"--policy-loss {name!r}; use one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
