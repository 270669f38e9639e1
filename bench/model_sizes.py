"""The sizes of the benchmark's models users train, without torch: `ps_bench.torch_models` builds them
in torch from these, `ps_bench.tf_ps` in Keras."""

#: The transformer classifier: token embedding, learned positions, post-norm encoder layers, mean pool.
VOCAB = 8000
SEQ_LEN = 64
D_MODEL = 384
HEADS = 6
FEED_FORWARD = 1536
LAYERS = 4
TEXT_CLASSES = 4
DROPOUT = 0.1

#: ResNet-18 for 32x32 images (CIFAR style): one example's shape (channels first), and the stages'
#: (channels, stride of the first block).
IMAGE_SHAPE = (3, 32, 32)
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))
IMAGE_CLASSES = 10
