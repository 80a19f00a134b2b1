"""Host cost of a Python autograd node against a C++ op, per node, forward and backward.

A chain of N nodes on a tiny tensor (the device finishes each kernel long before the host issues
the next): ``x * 1.0`` (a C++ autograd node) against an autograd.Function doing the same in
Python, forward and ``backward()`` timed apart. Session 4 on the H200's host: +6 to +8 us per
node forward, +3 to +7 us backward (docs/lab-notes.md, session 4 run 3), so the
Python nodes forge adds (~100 per train step of a 24-layer model) cost ~1-1.5 ms, not the bulk
of the host time.

    python bench/diag_pynode.py [cuda|cpu]
"""
import time, torch, sys
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x * 1.0
    @staticmethod
    def backward(ctx, g): return g * 1.0
N=200
x = torch.randn(16, device=dev, requires_grad=True)
def cpp():
    y = x
    for _ in range(N): y = y * 1.0
    return y
def py():
    y = x
    for _ in range(N): y = F.apply(y)
    return y
def sync():
    if dev == "cuda": torch.cuda.synchronize()
for name, f in (("cpp", cpp), ("py", py), ("cpp", cpp), ("py", py)):
    for _ in range(5): f().sum().backward()
    sync()
    tf = tb = 0
    for _ in range(20):
        t0 = time.perf_counter(); y = f().sum(); t1 = time.perf_counter(); y.backward(); sync(); t2 = time.perf_counter()
        tf += t1 - t0; tb += t2 - t1
    print(dev, name, "fwd us/node %.1f" % (tf / 20 / N * 1e6), "bwd us/node %.1f" % (tb / 20 / N * 1e6))
