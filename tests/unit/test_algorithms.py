"""Advantages, losses and KL control against values computed by hand (worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from toolkit.algorithms.advantages import gae, grpo_advantages, kl_penalized_rewards, last_token_index, masked_whiten
from toolkit.algorithms.kl_controller import AdaptiveKLController, FixedKLController
from toolkit.algorithms.losses import behaviour_weights, kl_estimate, masked_mean, policy_loss, value_loss

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_grpo_advantages():
    # group 0: [1,0,0], mean 1/3, deviations [2/3,-1/3,-1/3], sample var (4+1+1)/9/2 = 1/3, std 0.57735
    # group 1: [1,2,2], mean 5/3, deviations [-2/3,1/3,1/3], same std
    rewards = T([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = T([0, 0, 0, 7, 7, 7])
    s = 1 / math.sqrt(1 / 3)
    assert close(grpo_advantages(rewards, groups), [2 / 3 * s, -1 / 3 * s, -1 / 3 * s, -2 / 3 * s, 1 / 3 * s, 1 / 3 * s],
                 1e-4)
    assert close(grpo_advantages(rewards, groups, normalize_std=False), [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    # groups may be interleaved; equal rewards and single-sample groups give 0
    assert close(grpo_advantages(T([3.0, 5.0, 3.0, 1.0]), T([1, 2, 1, 3])), [0, 0, 0, 0])
    # equal rewards that float32 cannot hold exactly give exactly 0 too: the float32 mean missed them by a
    # rounding step, the std was made of that rounding, and every sample of the group got the same +-0.01-0.86
    for value, size in ((0.1, 7), (0.7, 16), (2.7, 16), (13.7, 16), (100.3, 3)):
        rewards = torch.cat([torch.full((size,), value), T([0.0, 1.0])])
        advantages = grpo_advantages(rewards, torch.cat([torch.zeros(size), T([1, 1])]))
        assert advantages[:size].abs().max().item() == 0.0 and close(advantages[size:], [-0.7071, 0.7071], 1e-4)
        assert advantages.dtype == torch.float32
    # and a group that differs by little still gets its signal, whatever the size of the rewards
    assert close(grpo_advantages(T([100.3, 100.3, 100.31]), T([0, 0, 0])), [-0.5774, -0.5774, 1.1547], 1e-3)


def test_last_token_index():
    mask = T([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 3, 0]


def test_kl_penalized_rewards():
    # kl = lp - ref = [0.5, 0, 0.5]; r = -0.1 * kl, plus the score 2 on the last response token
    lp, ref = T([[-1.0, -2.0, -0.5, 0.0]]), T([[-1.5, -2.0, -1.0, 0.0]])
    rewards = kl_penalized_rewards(T([2.0]), lp, ref, T([[1.0, 1.0, 1.0, 0.0]]), 0.1)
    assert close(rewards, [[-0.05, 0.0, 1.95, 0.0]])


def test_gae_by_hand():
    # gamma 1, lambda 0.5, r = [0,0,1], V = [.5,.6,.7]:
    # t2: delta = 1 - .7 = .3, A = .3; t1: delta = .7 - .6 = .1, A = .1 + .5*.3 = .25; t0: .1 + .5*.25 = .225
    rewards, values, mask = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1.0, 1.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert close(adv, [[0.225, 0.25, 0.3]]) and close(ret, [[0.725, 0.85, 1.0]])
    # gamma .9: t2: A = .3; t1: delta = .9*.7 - .6 = .03, A = .03 + .45*.3 = .165; t0: .9*.6 - .5 = .04 + .45*.165
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert close(adv, [[0.04 + 0.45 * 0.165, 0.165, 0.3]])


def test_gae_ignores_prompt_and_padding():
    # the same response inside [prompt | response x3 | padding]; values outside the span must not leak in
    rewards = T([[5.0, 0.0, 0.0, 1.0, 7.0]])
    values = T([[9.0, 0.5, 0.6, 0.7, 9.0]])
    mask = T([[0.0, 1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert close(adv, [[0.0, 0.225, 0.25, 0.3, 0.0]]) and close(ret, [[0.0, 0.725, 0.85, 1.0, 0.0]])


def test_masked_whiten():
    # entries 1, 2, 3 (100 is masked out): mean 2, var 2/3
    x, mask = T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    z = 1 / math.sqrt(2 / 3)
    assert close(masked_whiten(x, mask), [[-z, 0.0, z, 0.0]], 1e-4)
    # with statistics summed across two identical ranks the result is the same
    assert close(masked_whiten(x, mask, all_reduce=lambda t: t * 2), [[-z, 0.0, z, 0.0]], 1e-4)


def test_masked_whiten_keeps_a_small_spread_around_a_large_mean():
    """Returns of saturated rewards: std 0.001 around 5 whitened to std 0.72 when the statistics were float32."""
    g = torch.Generator().manual_seed(0)
    for mean, std in ((5.0, 1e-3), (50.0, 1e-2), (1.0, 1e-4)):
        x = (mean + std * torch.randn(4, 64, generator=g, dtype=torch.float64)).float()
        mask = torch.ones_like(x)
        mask[:, 50:] = 0
        z = masked_whiten(x, mask)
        kept = x.double()[:, :50]
        expected = (x.double() - kept.mean()) / (kept.var(unbiased=False) + 1e-8).sqrt() * mask.double()  # (eps)
        assert z.dtype == torch.float32 and (z.double() - expected).abs().max().item() < 1e-3, (mean, std)


def test_policy_loss_by_hand():
    # ratio [1.5, 0.5], eps .2, A = +1: min([1.5, .5], [1.2, .8]) = [1.2, .5] -> loss -(1.7)/2 = -.85
    # A = -1: min([-1.5, -.5], [-1.2, -.8]) = [-1.5, -.8] -> loss 2.3/2 = 1.15; a masked third token is ignored
    old = T([[0.0, 0.0, 0.0]])
    lp = T([[math.log(1.5), math.log(0.5), 50.0]])
    mask = T([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(lp, old, T([[1.0, 1.0, 1.0]]), mask, 0.2)
    assert close(loss, -0.85) and close(stats["clip_frac"], 0.5)
    loss, stats = policy_loss(lp, old, T([[-1.0, -1.0, -1.0]]), mask, 0.2)
    assert close(loss, 1.15) and close(stats["clip_frac"], 0.5)
    # approx_kl = mean of 0.5 * log_ratio^2
    assert close(stats["approx_kl"], 0.25 * (math.log(1.5) ** 2 + math.log(0.5) ** 2))


def test_policy_loss_with_behaviour_weights_by_hand():
    # Same tokens as above, A = +1, weighted [2, 0.5]: -(2 * 1.2 + 0.5 * 0.5) / 2 = -1.325
    lp = T([[math.log(1.5), math.log(0.5), 50.0]])
    loss, _ = policy_loss(lp, T([[0.0, 0.0, 0.0]]), T([[1.0, 1.0, 1.0]]), T([[1.0, 1.0, 0.0]]), 0.2,
                          weights=T([[2.0, 0.5, 7.0]]))
    assert close(loss, -1.325)


def test_behaviour_weights_are_truncated_ratios():
    # old - behaviour = [log 1.5, log 0.25, 5, -100] -> exp = [1.5, 0.25, 148.4, ~0], capped at 2
    old = T([[math.log(1.5), math.log(0.25), 5.0, -100.0]])
    weights = behaviour_weights(old, T([[0.0, 0.0, 0.0, 0.0]]), cap=2.0)
    assert close(weights, [[1.5, 0.25, 2.0, 0.0]])
    assert not weights.requires_grad


def test_policy_loss_gradient_is_zero_when_clipped():
    lp = T([[math.log(1.5)]]).requires_grad_()
    loss, _ = policy_loss(lp, T([[0.0]]), T([[1.0]]), T([[1.0]]), 0.2)
    loss.backward()
    assert lp.grad.abs().item() == 0.0


def test_value_loss_by_hand():
    # clipped = .5 + clamp([.5, -.5], +-.2) = [.7, .3]; (v-R)^2 = [1, 0]; (vc-R)^2 = [1.69, .09]
    # loss = .5 * mean(max) = .5 * (1.69 + .09) / 2 = .445
    loss, stats = value_loss(T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[2.0, 0.0]]), T([[1.0, 1.0]]), 0.2)
    assert close(loss, 0.445) and close(stats["value_clip_frac"], 1.0)


def test_kl_estimators():
    # log p - log q = 1: k1 = 1, k2 = .5, k3 = e^-1 - 1 + 1
    lp, ref = T([-1.0]), T([-2.0])
    assert close(kl_estimate(lp, ref, "k1"), [1.0])
    assert close(kl_estimate(lp, ref, "k2"), [0.5])
    assert close(kl_estimate(lp, ref, "k3"), [math.exp(-1)])
    assert close(kl_estimate(ref, ref, "k3"), [0.0])
    # k3 overflows where the log-prob is far below the reference's (a prompt or padding position, whose ref
    # is 0): the GRPO loss takes the policy's log-prob only on response tokens, so the mask keeps it finite
    assert kl_estimate(T([-95.0]), T([0.0]), "k3").isinf().all()
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(lp, ref, "k4")


def test_masked_mean():
    assert close(masked_mean(T([[1.0, 3.0, 100.0]]), T([[1.0, 1.0, 0.0]])), 2.0)
    assert close(masked_mean(T([[1.0, 3.0], [5.0, 7.0]]), T([[1.0, 0.0], [1.0, 1.0]]), dim=1), [1.0, 6.0])
    assert masked_mean(T([1.0]), T([0.0])).item() == 0.0


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 1000)
    assert fixed.coef == 0.1
    # error = clip(kl/target - 1, +-.2); coef *= 1 + error * n / horizon
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(9.0, 1000)   # error .5 -> .2: x1.02
    assert close(c.coef, 0.102)
    c.update(3.0, 1000)   # error -.5 -> -.2: x0.98
    assert close(c.coef, 0.102 * 0.98)
    c.update(6.6, 1000)   # error .1: x1.01
    assert close(c.coef, 0.102 * 0.98 * 1.01)
    restored = AdaptiveKLController(1.0, 6.0, 10000)
    restored.load_state_dict(c.state_dict())
    assert restored.coef == c.coef
    # a fixed coefficient is the config's at a resume: algorithm.kl.coef raised from 0.01 to 0.2 in the run's
    # config.yaml went on at 0.01, the checkpoint's, with nothing said
    edited = FixedKLController(0.2)
    edited.load_state_dict(FixedKLController(0.01).state_dict())
    assert edited.coef == 0.2
    # a step of more samples than the horizon moves it by at most 20% (the factor went below 0 past 5 x horizon,
    # and the coefficient then rewarded moving away from the reference); a KL that is not a number leaves it
    c = AdaptiveKLController(0.05, target=6.0, horizon=100)
    c.update(0.5, 1024)
    assert close(c.coef, 0.04)
    c.update(float("nan"), 1024)
    assert close(c.coef, 0.04)


def test_rloo_leave_one_out_by_hand():
    # group 0 rewards [1, 0, 2]: baselines (0+2)/2=1, (1+2)/2=1.5, (1+0)/2=0.5 -> A = [0, -1.5, 1.5]
    # group 5 rewards [4, 2]: A = [2, -2]; a group of one sample: 0
    from toolkit.algorithms.advantages import rloo_advantages

    rewards = T([1.0, 4.0, 0.0, 2.0, 2.0, 9.0])
    groups = T([0, 5, 0, 0, 5, 8])
    assert close(rloo_advantages(rewards, groups), [0.0, 2.0, -1.5, 1.5, -2.0, 0.0])
    # = k/(k-1) (r - group mean): mean of group 0 is 1, so 3/2 * [0, -1, 1]
    assert close(rloo_advantages(T([1.0, 0.0, 2.0]), T([0, 0, 0])), [0.0, -1.5, 1.5])
    # equal rewards give exactly 0 whatever their size: in float32, sum - r_i of four 1000.1 left 6.1e-05 each,
    # and of three 12345.7 -0.00098 each
    advantages = rloo_advantages(T([1000.1] * 4 + [12345.7] * 3 + [0.0, 1.0]), T([0] * 4 + [1] * 3 + [2, 2]))
    assert advantages[:7].abs().max().item() == 0.0 and close(advantages[7:], [-1.0, 1.0])
    assert advantages.dtype == torch.float32


def test_reinforce_pp_returns_normalised_over_the_batch_by_hand():
    # two responses (mask 0 outside), per-token rewards (KL penalty, the score on the last token):
    #   row 0: r = [ -0.1, 0.9, (pad) ] -> returns (gamma 1) [0.8, 0.9, 0]
    #   row 1: r = [ (prompt), 0.2, -0.2 ] -> returns [0, 0.0, -0.2]
    # over the 4 masked tokens [0.8, 0.9, 0.0, -0.2]: mean 0.375, var (0.180625+0.275625+0.140625+0.330625)/4
    #   = 0.231875, std 0.481534 -> A = (G - 0.375) / 0.481534
    from toolkit.algorithms.advantages import reinforce_pp_advantages

    rewards = T([[-0.1, 0.9, 0.0], [0.0, 0.2, -0.2]])
    mask = T([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    std = math.sqrt(0.231875)
    assert close(adv, [[(0.8 - 0.375) / std, (0.9 - 0.375) / std, 0.0], [0.0, (0.0 - 0.375) / std, (-0.2 - 0.375) / std]],
                 1e-4)
    # the statistics are summed over data-parallel ranks: a second rank with the same tokens changes nothing
    assert close(reinforce_pp_advantages(rewards, mask, 1.0, all_reduce=lambda t: 2 * t), adv, 1e-5)
    # gamma discounts: row 0 with gamma 0.5: returns [-0.1 + 0.45, 0.9]
    raw = reinforce_pp_advantages(rewards[:1], mask[:1], gamma=0.5)
    g = T([0.35, 0.9])
    assert close(raw[0, :2], (g - g.mean()) / g.std(unbiased=False), 1e-4)


def test_response_lm_loss_counts_response_tokens_only():
    # logits predict token t+1 from position t; uniform logits over 4 tokens: loss log 4 per target.
    from toolkit.algorithms.supervised import pairwise_loss, response_lm_loss

    ids = T([[1, 2, 3, 0]])
    mask = T([[0, 0, 1, 1]])  # the response is tokens 2 and 3 (positions 2, 3)
    logits = torch.zeros(1, 4, 4)
    total, count = response_lm_loss(logits, ids, mask)
    assert count.item() == 2 and close(total, 2 * math.log(4))
    logits[0, 1, 3] = 100.0  # position 1 predicts token 3 (at position 2) with certainty: its loss is ~0
    total, count = response_lm_loss(logits, ids, mask)
    assert close(total, math.log(4), 1e-4)
    # pairwise: margins [2, -1]: loss mean(-log sigmoid) = (0.126928 + 1.313262) / 2; accuracy 1/2; margin 0.5
    loss, stats = pairwise_loss(T([3.0, 0.0]), T([1.0, 1.0]))
    assert close(loss, (0.126928 + 1.313262) / 2, 1e-5)
    assert stats["accuracy"].item() == 0.5 and close(stats["margin"], 0.5)
