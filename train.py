#!/usr/bin/env python
"""Thin entry point: ``python train.py --task NAME ...`` (see README)."""

from hetseq.app.main import main

if __name__ == "__main__":
    main()
