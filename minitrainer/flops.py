"""``python -m minitrainer.flops`` as before the move: ``minitrainer/setup/flops.py``."""

from minitrainer.setup.flops import main

if __name__ == "__main__":
    main()
