"""The MMSegmentation pieces: InternViT, its recipes, the linear head,
the toy segmenter end to end."""
