"""GRPO from scratch on a toy counting task, with ``ratiokl.torch.loss.policy_loss``.

    python examples/grpo_torch.py            # CPU, well under a minute

The task: given a prompt digit ``p`` (0..8), answer ``p, p+1, ...`` (mod 9)
for ``2 + p % 3`` tokens, then the end token. The reward is verifiable: the
fraction of answer positions (the end token included) that are right. The
policy is a small MLP over (prompt, position, previous token); it samples
answers token by token, tokens after the end token are inactive (``mask``
False), and each update is a GRPO step: group-normalised advantages, the
clipped surrogate with clip-higher and a k3 KL penalty against the initial
policy, ``seq-mean-token-mean`` aggregation, two epochs per batch.

``examples/grpo_jax.py`` is the same program in JAX: the same NumPy initial
weights, prompts and sampling noise give the same reward curve.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ratiokl.torch import loss

VOCAB, END, MAX_LEN = 10, 9, 6  # tokens 0..8 are digits, 9 ends the answer
HIDDEN, GROUPS, GROUP_SIZE, STEPS, EPOCHS, LR = 64, 16, 8, 80, 2, 0.02
FEATURES = 9 + MAX_LEN + VOCAB + 1  # one-hot prompt, position, previous token (or start)
#: Adam epsilon: large enough that gradients at float32 rounding level (which the two
#: frameworks round differently) move no weight, so both frameworks follow one curve.
ADAM_EPS = 1e-6


# ---- the task and the rollout (NumPy; identical in grpo_jax.py) ----------------------------

def targets(prompts: np.ndarray) -> np.ndarray:
    """``[N, MAX_LEN]`` correct answers; -1 after the end token."""
    out = np.full((len(prompts), MAX_LEN), -1)
    for i, p in enumerate(prompts):
        n = 2 + p % 3
        out[i, :n] = (p + np.arange(n)) % 9
        out[i, n] = END
    return out


def reward(actions: np.ndarray, mask: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """Fraction of the answer's positions (end token included) the sample got right."""
    want = targets(prompts)
    scored = want >= 0
    hits = (actions == want) & mask & scored
    return hits.sum(1) / scored.sum(1)


def features(prompts: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """``[N, MAX_LEN, FEATURES]`` float32 inputs of every position (teacher forcing)."""
    n = len(prompts)
    x = np.zeros((n, MAX_LEN, FEATURES), np.float32)
    x[np.arange(n)[:, None], np.arange(MAX_LEN), prompts[:, None]] = 1.0
    x[:, np.arange(MAX_LEN), 9 + np.arange(MAX_LEN)] = 1.0
    previous = np.concatenate([np.full((n, 1), VOCAB), actions[:, :-1]], axis=1)
    x[np.arange(n)[:, None], np.arange(MAX_LEN), 9 + MAX_LEN + previous] = 1.0
    return x


def numpy_policy(weights, x: np.ndarray) -> np.ndarray:
    """The policy's logits in float64 NumPy (sampling does not depend on the framework)."""
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in weights)
    return np.tanh(x @ w1 + b1) @ w2 + b2


def sample(weights, prompts: np.ndarray, rng: np.random.Generator):
    """Sample answers token by token; returns ``(actions, mask)`` (False after the end)."""
    n = len(prompts)
    actions = np.zeros((n, MAX_LEN), np.int64)
    alive = np.ones(n, bool)
    mask = np.zeros((n, MAX_LEN), bool)
    for t in range(MAX_LEN):
        logits = numpy_policy(weights, features(prompts, actions))[:, t]
        probs = np.exp(logits - logits.max(1, keepdims=True))
        cdf = np.cumsum(probs / probs.sum(1, keepdims=True), axis=1)
        token = np.minimum((cdf < rng.random((n, 1))).sum(1), VOCAB - 1)
        actions[:, t] = np.where(alive, token, 0)
        mask[:, t] = alive
        alive &= token != END
    return actions, mask


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """GRPO: each sample's reward against its group's mean and standard deviation."""
    r = rewards.reshape(GROUPS, GROUP_SIZE)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)
    return adv.reshape(-1).astype(np.float32)


def initial_weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        rng.normal(0.0, FEATURES**-0.5, (FEATURES, HIDDEN)).astype(np.float32),
        np.zeros(HIDDEN, np.float32),
        rng.normal(0.0, HIDDEN**-0.5, (HIDDEN, VOCAB)).astype(np.float32),
        np.zeros(VOCAB, np.float32),
    ]


def progress(step: int, rewards, losses) -> str:
    done = int(30 * step / STEPS)
    bar = "#" * done + "-" * (30 - done)
    return f"[{bar}] {step:3d}/{STEPS}  reward {rewards[-1]:.3f}  loss {losses[-1]:+.4f}"


# ---- the PyTorch part -----------------------------------------------------------------------

def policy(params, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def main() -> None:
    torch.manual_seed(0)
    params = [torch.tensor(w, requires_grad=True) for w in initial_weights()]
    reference = [p.detach().clone() for p in params]
    opt = torch.optim.Adam(params, lr=LR, eps=ADAM_EPS)
    rng = np.random.default_rng(1)
    rewards, losses = [], []
    start = time.time()
    for step in range(1, STEPS + 1):
        prompts = np.repeat(rng.integers(0, 9, GROUPS), GROUP_SIZE)
        actions, mask = sample([p.detach().numpy() for p in params], prompts, rng)
        r = reward(actions, mask, prompts)
        x = torch.from_numpy(features(prompts, actions))
        ids, active = torch.from_numpy(actions), torch.from_numpy(mask)
        adv = torch.from_numpy(group_advantages(r))
        with torch.no_grad():
            ref_logits = policy(reference, x)
            old_logps = loss.selected_logprobs(policy(params, x), ids, active)
        for _ in range(EPOCHS):
            value, metrics = loss.policy_loss(
                policy(params, x), ref_logits, ids, active, old_logps, adv,
                clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.005, loss_agg="seq-mean-token-mean",
            )
            opt.zero_grad()
            value.backward()
            opt.step()
        rewards.append(float(r.mean()))
        losses.append(value.item())
        end = "\n" if step % 10 == 0 else ""
        print("\r" + progress(step, rewards, losses), end=end, flush=True)
    print(f"reward: first {rewards[0]:.3f} -> last {rewards[-1]:.3f} "
          f"(mean of the last 10: {np.mean(rewards[-10:]):.3f}); {time.time() - start:.1f} s; "
          f"last clip_fraction {metrics['clip_fraction'].item():.3f}, "
          f"kl_mean {metrics['kl_mean'].item():.4f}")


if __name__ == "__main__":
    main()
