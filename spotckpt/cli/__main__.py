"""``python -m spotckpt.cli``, where the console script is not installed."""

from spotckpt.cli import main

if __name__ == "__main__":
    main()
