"""Data shared by training and evaluation: the house model's synthetic retrieval samples."""
