"""What the two backend-neutral nodes' adaptors (forge.ops.gated_mlp, forge.ops.precomputed)
share for forge.ops.library: one op pair each (``DEF``), always with a backward, opaque to
inductor. Imports nothing."""
from __future__ import annotations


class NodeAdaptorBase:
    DEF = None  # the node's kernel definition (name, input names)

    def install(self, traced):
        self.traced = traced

    def kernels(self):
        return [self.DEF]

    def op_name(self, kdef):
        return kdef.name

    def has_bwd(self, kdef):
        return True

    def traced_bwd(self, kdef):
        """None: the node's backward is its backward op. Otherwise a function of the backward op's
        arguments returning {input name: gradient} from plain torch ops, which the compiled
        backward traces in place of an op."""
        return None

    def inductor(self, kdef):
        return False

    def wrapped(self, body):
        return body
