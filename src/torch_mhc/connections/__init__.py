"""The connections, as drop-in nn.Modules around a branch (attention, MLP, any block).

base (the Connection base class, Residual, HC, mHC, the factory), successors (mHC-lite,
KromHC, static H_res), stream_head (DeepSeek-V4's learned stream reduction).
"""
