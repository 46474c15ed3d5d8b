"""Reinforcement learning: the algorithmic core the RL loop is built from.

    algorithms.py   advantages (dr_grpo, grpo, rloo), KL estimators (k1, k2, k3), the policy loss
    rewards.py      the concave length penalty, effort, the reward-term registry and scoring
    packing.py      cost-balanced packing across data-parallel ranks, micro-batches under a token budget
"""
