"""`mhc upcycle`: a trained residual run converted, function-preserving, to other connection
kinds, and every conversion trained on beside a residual continuation.

    mhc upcycle --from runs/res --kinds hc,mhc --steps 200 --seeds 3 --out runs/up

The parts:
- source: the residual run read and checked (`read_source`), the weight copy into a fresh LM
  of another kind (`upcycled_model`) and the step-0 checkpoint a continuation starts from;
- run: `upcycle()`, the continuations in order;
- report: upcycle.json, report.md and loss_curves.png;
- command: the command line (`add_arguments`, `run_command`), light enough to build with
  every `mhc` parser.
"""
