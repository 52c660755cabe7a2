"""Steering the local model: fit control vectors from contrast prompts, read out where a concept is steerable."""
