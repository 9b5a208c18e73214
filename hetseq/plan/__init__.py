"""The plan of shares: each rank's part of the global batch, measured and re-planned."""
