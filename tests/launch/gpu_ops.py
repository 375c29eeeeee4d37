"""The public functions on a GPU, for the launch tests (tests/test_direct_launch.py) and
check_native_calls.py: attention (causal, and with dropout; forward and backward), LayerNorm with
a residual, RMSNorm (forward and backward) and causal linear attention."""
import torch


def public_ops():
    """(run, (q, k, v)): run() computes every op once (the dropout seed drawn afresh from seed 1)
    and returns copies of every result and gradient; q, k and v are its attention inputs."""
    import transformer_fast as tf

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    x, r = torch.randn(2, 300, 96, device="cuda"), torch.randn(2, 300, 96, device="cuda")
    w, b = (torch.randn(96, device="cuda", requires_grad=True) for _ in range(2))
    xg = x.clone().requires_grad_()

    def run():
        for t in (q, k, v, w, b, xg):
            t.grad = None
        torch.manual_seed(1)  # the dropout seed
        out = tf.scaled_dot_product_attention(q, k, v, is_causal=True)
        dropped = tf.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        (out.float().square().sum() + dropped.float().sum()).backward()
        y, h = tf.layer_norm(xg, (96,), w, b, residual=r)
        (y * h).sum().backward()
        z = tf.rms_norm(xg, (96,), w)
        z.sum().backward()
        lin = tf.linear_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
        return [t.detach().clone() for t in (out, dropped, q.grad, k.grad, v.grad, y, h, z, xg.grad, w.grad, b.grad,
                                             lin)]
    return run, (q, k, v)
