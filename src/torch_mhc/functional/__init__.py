"""Pure maths, no nn.Module: the Sinkhorn projection and its autograd, the maps of every
connection (the reference every kernel is held to), and the successors' H_res maps.

Needs torch alone; imports nothing else of the package.
"""
