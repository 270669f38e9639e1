"""Data files shipped with the models package (digits.npz) and the script that made them."""
