"""A zoo of tiny keras-hub models built from config, with inputs to feed.

`cases()` lists every public keras-hub backbone and task that this module
builds offline: random weights, tiny sizes (1-2 layers, widths 8-64, a
vocabulary of 64, 32x32 images), no preset, tokenizer or vocabulary download.
Tasks are built on their tiny backbone with `preprocessor=None`, so they take
the backbone-style inputs (token ids and masks, or images). `skipped()` names
the other public backbone and task classes, with the reason.

`trained_task(name, optimizer)` gives one of the tasks users fine-tune
(`TRAINED`: a causal LM, a text and an image classifier), compiled with the
user's optimizer and trained a few steps.

Nothing is built until `Case.build()` is called, and it builds under the
global dtype policy in force then. Run as a script,

    python tests/support/hub_zoo.py [--policy mixed_float16] [--only A,B]
        [--quick] [--loss]

it builds each case, calls it once (and evaluates the loss with `--loss`) and
prints a line per case: name, kind, F(unctional) or S(ubclassed), parameter
count, build and total seconds, and ok or the error.
"""

import argparse
import dataclasses
import importlib
import inspect
import sys
import time
from importlib.util import find_spec
from typing import Any
from typing import Callable

import keras
import numpy as np


class _LazyModule:
    """keras_hub, imported on first use: pytest's --doctest-modules imports
    every module under tests/, with or without keras-hub installed."""

    def __getattr__(self, name):
        if name.startswith("__"):  # what pytest looks for, such as __wrapped__
            raise AttributeError(name)
        return getattr(importlib.import_module("keras_hub"), name)


keras_hub = _LazyModule()

V = 64  # vocabulary size of every text model
S = 8  # length of every token sequence
HW = 32  # height and width of most images
NUM_CLASSES = 3
MASKED = 2  # positions per sequence that a MaskedLM predicts


@dataclasses.dataclass
class Case:
    name: str  # the keras-hub class name, such as "GPT2CausalLM"
    kind: str  # "backbone" | "task"
    build: Callable[[], keras.Model]  # under the current dtype policy
    inputs: Callable[[int], Any]  # batch_size -> numpy inputs
    targets: Callable[[int], Any] | None = None  # y for the default loss
    notes: str = ""
    family: str = ""  # decoder, encoder, encdec, conv, vit or multimodal
    quick: bool = False  # in the small subset covering every family
    mixed_failure: str = ""  # why keras-hub fails under mixed_* policies


# -- Inputs --------------------------------------------------------------------
# A spec is a (shape without the batch, kind) pair or a dict of them. Kinds:
# "ids" token ids in [1, V), "cls" class ids, "onehot" one-hot classes, "pos"
# 0, 1, 2..., "rand" uniform float32 in [0, 1), "bool" True, "ones", "zeros".


def _feed(spec, batch, seed=0):
    rng = np.random.default_rng(seed)

    def make(shape, kind):
        shape = (batch, *shape)
        if kind == "ids":
            return rng.integers(1, V, shape).astype("int32")
        if kind == "cls":
            return rng.integers(0, NUM_CLASSES, shape).astype("int32")
        if kind == "onehot":
            labels = rng.integers(0, NUM_CLASSES, shape[:-1])
            return np.eye(NUM_CLASSES, dtype="float32")[labels]
        if kind == "pos":
            return np.ones(shape, "int32") * np.arange(shape[-1], dtype="int32")
        if kind == "rand":
            return rng.random(shape, dtype="float32")
        if kind == "bool":
            return np.ones(shape, "bool")
        return (np.ones if kind == "ones" else np.zeros)(shape, "int32")

    if isinstance(spec, dict):
        return {key: make(*value) for key, value in spec.items()}
    return make(*spec)


def _text(*keys, mask="ones", prefix=""):
    kinds = {"token_ids": "ids", "segment_ids": "zeros"}
    return {prefix + k: ((S,), kinds.get(k, mask)) for k in keys}


def _img(h=HW, w=HW):
    return ((h, w, 3), "rand")


TOK = _text("token_ids", "padding_mask")
SEG = _text("token_ids", "segment_ids", "padding_mask")
ENCDEC = {**_text("token_ids", "padding_mask", prefix="encoder_"),
          **_text("token_ids", "padding_mask", prefix="decoder_")}  # fmt: skip
IMG = _img()

# -- Backbones -----------------------------------------------------------------
# name -> (family, kwargs or a function returning them, input spec). A name
# "Class/variantBackbone" builds ClassBackbone another way, for a task.

# fmt: off
_dec = dict(vocabulary_size=V, num_layers=1, hidden_dim=16)
_mha = dict(_dec, num_heads=2, intermediate_dim=32)
_mlen = dict(_mha, max_sequence_length=16)
_llama = dict(_dec, num_query_heads=2, num_key_value_heads=1,
              intermediate_dim=32)
_moe = dict(_llama, moe_intermediate_dim=16, num_experts=4, top_k=2)
_smol = dict(
    _dec, intermediate_dim=32, num_attention_heads=2, num_key_value_heads=1,
    attention_bias=False, attention_dropout=0.0, mlp_bias=False,
    rope_layer_enabled_list=[True], layer_types=["attention"],
    layer_norm_epsilon=1e-5, max_position_embeddings=32,
    rope_theta=10000.0, partial_rotary_factor=1.0)
_qwen35 = dict(
    _llama, num_layers=2, head_dim=8, linear_num_key_heads=2,
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4)
_t5gemma = dict(vocabulary_size=V, sliding_window=4)
for _p in ("encoder", "decoder"):
    _t5gemma.update({
        f"{_p}_hidden_dim": 16, f"{_p}_intermediate_dim": 32,
        f"{_p}_num_layers": 1, f"{_p}_num_attention_heads": 2,
        f"{_p}_num_key_value_heads": 1, f"{_p}_head_dim": 8,
        f"{_p}_layer_types": ["full_attention"]})
_vit = dict(num_layers=1, num_heads=2, hidden_dim=16)
_shape = dict(image_shape=(HW, HW, 3))
_resnet = dict(
    input_conv_filters=[8], input_conv_kernel_sizes=[3],
    stackwise_num_filters=[64, 8, 8, 8], stackwise_num_blocks=[1] * 4,
    stackwise_num_strides=[1, 2, 2, 2], block_type="bottleneck_block")
_resnet3 = {k: v[:3] if k.startswith("stackwise") else v
            for k, v in _resnet.items()}
_mit = dict(
    _shape, layerwise_depths=[1, 1], hidden_dims=[4, 8], num_layers=2,
    layerwise_num_heads=[1, 2], layerwise_sr_ratios=[8, 4],
    max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3],
    layerwise_strides=[4, 2])
_dinov2 = dict(
    _vit, **_shape, patch_size=8, intermediate_dim=32,
    position_embedding_shape=(HW, HW, 3))
_hgnetv2 = dict(
    _shape, stem_channels=[3, 8, 8], depths=[1, 1], hidden_sizes=[16, 32],
    stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
    apply_downsample=[False, True], use_lightweight_conv_block=[False] * 2,
    embedding_size=8, use_learnable_affine_block=True, hidden_act="relu")
_mnv5 = {f"stackwise_{k}": v for k, v in dict(
    block_types=[["er"], ["uir"]], num_blocks=[1, 1],
    num_filters=[[8], [16]], strides=[[2], [2]],
    act_layers=[["relu"], ["relu"]], exp_ratios=[[2.0], [2.0]],
    se_ratios=[[0.0], [0.0]], dw_kernel_sizes=[[0], [3]],
    dw_start_kernel_sizes=[[0], [0]], dw_end_kernel_sizes=[[0], [0]],
    exp_kernel_sizes=[[3], [0]], pw_kernel_sizes=[[1], [0]],
    num_heads=[[0], [0]], key_dims=[[0], [0]], value_dims=[[0], [0]],
    kv_strides=[[0], [0]], use_cpe=[[False], [False]]).items()}


def _sub(cls, kwargs, **extra):
    return getattr(keras_hub.models, cls + "Backbone")(**{**kwargs, **extra})


def _towers(prefix):
    m = keras_hub.models
    kw = dict(
        vision_encoder=getattr(m, prefix + "VisionEncoder")(
            8, 16, 1, 2, 32, image_shape=(HW, HW, 3)),
        text_encoder=getattr(m, prefix + "TextEncoder")(
            V, 16, 16, 1, 2, 32, max_sequence_length=S))
    return kw if prefix == "SigLIP" else dict(kw, projection_dim=16)


def _blip2(t5=False):
    m = keras_hub.models
    lm_cls = m.BLIP2FlanT5 if t5 else m.BLIP2CustomOPT
    lm_kw = dict(key_value_dim=4) if t5 else dict(max_sequence_length=16)
    return dict(
        vision_encoder=m.BLIP2VisionEncoder(
            image_size=HW, patch_size=8, num_layers=1, num_heads=2,
            hidden_dim=8, intermediate_dim=16, use_patch_bias=True,
            use_class_token=True, use_mha_bias=True, use_mlp_bias=True,
            dropout_rate=0.0, layer_norm_epsilon=1e-6,
            initializer_range=0.02),
        qformer=m.BLIP2QFormer(
            num_query_tokens=2, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, vision_dim=8, cross_attention_frequency=1,
            dropout=0.0, layer_norm_epsilon=1e-6),
        language_model=lm_cls(
            vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, num_query_tokens=2, qformer_hidden_dim=8,
            language_projection=None, dropout=0.0, **lm_kw))


def _sam():
    layers = keras_hub.layers
    return dict(
        image_encoder=keras_hub.models.ViTDetBackbone(
            hidden_size=16, num_layers=2, intermediate_dim=32, num_heads=2,
            global_attention_layer_indices=[1], patch_size=4,
            num_output_channels=8, window_size=2, image_shape=(16, 16, 3)),
        prompt_encoder=layers.SAMPromptEncoder(
            hidden_size=8, image_embedding_size=(4, 4),
            input_image_size=(16, 16), mask_in_channels=16),
        mask_decoder=layers.SAMMaskDecoder(
            num_layers=1, hidden_size=8, intermediate_dim=16, num_heads=2,
            embedding_dim=8, num_multimask_outputs=3, iou_head_depth=2,
            iou_head_hidden_dim=8))


def _sam3():
    layers, shape = keras_hub.layers, (28, 28, 3)
    small = dict(hidden_dim=16, num_heads=2)
    mlp = dict(small, num_layers=1, intermediate_dim=32)
    return dict(
        vision_encoder=layers.SAM3VisionEncoder(
            image_shape=shape, patch_size=14, fpn_hidden_dim=16,
            fpn_scale_factors=[4.0, 2.0, 1.0, 0.5], window_size=2,
            pretrain_image_shape=(42, 42, 3), global_attn_indexes=[0], **mlp),
        text_encoder=layers.SAM3TextEncoder(
            vocabulary_size=V, embedding_dim=16, **mlp),
        geometry_encoder=layers.SAM3GeometryEncoder(roi_size=7, **mlp),
        detr_encoder=layers.SAM3DetrEncoder(**mlp),
        detr_decoder=layers.SAM3DetrDecoder(
            image_shape=shape, patch_size=14, num_queries=8, **mlp),
        mask_decoder=layers.SAM3MaskDecoder(num_upsampling_stages=3, **small))


_BACKBONES = {}


def _add(family, spec, **configs):
    for name, kwargs in configs.items():
        _BACKBONES[name + "Backbone"] = (family, kwargs, spec)


_add("decoder", TOK, GPT2=_mlen, GPTNeoX=_mlen, OPT=_mlen, Bloom=_mha,
     Llama=_llama, Llama3=_llama, Phi3=_llama, Qwen=_llama, SmolLM3=_smol,
     Gemma=dict(_llama, head_dim=8), Qwen3=dict(_llama, head_dim=8),
     Gemma3=dict(_llama, head_dim=8, image_size=16),
     Falcon=dict(_dec, num_attention_heads=2, intermediate_dim=32),
     GptOss=dict(_llama, num_experts=2, top_k=2, sliding_window=4),
     Mistral=dict(_llama, sliding_window=4),
     Mixtral=dict(_llama, num_experts=2, top_k=2, sliding_window=4),
     QwenMoe=dict(_moe, shared_expert_intermediate_dim=16),
     Qwen3Moe=dict(_moe, head_dim=8),
     Qwen3_5=dict(_qwen35, intermediate_dim=32),
     Qwen3_5Moe=dict(_qwen35, moe_intermediate_dim=8, num_experts=4, top_k=2,
                     shared_expert_intermediate_size=8),
     RWKV7=dict(vocabulary_size=V, hidden_size=16, head_size=4, num_layers=1,
                intermediate_dim=32, gate_lora=8, mv_lora=8, aaa_lora=8,
                decay_lora=8))
_add("decoder", _text("token_ids", "padding_mask", mask="bool"), Gemma3n=dict(
    text_vocab_size=V, text_hidden_size=8, num_hidden_layers=1,
    pad_token_id=0, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
    intermediate_size=[16], hidden_activation="gelu_approximate",
    layer_types=["full_attention"], sliding_window=4, rope_theta=1e4,
    max_position_embeddings=16, vocab_size_per_layer_input=V,
    hidden_size_per_layer_input=2, altup_num_inputs=2, laurel_rank=1))
_add("decoder", dict(TOK, position_ids=((S,), "pos")), Gemma4=dict(
    _llama, head_dim=8, image_size=16, sliding_window_size=4))
_add("encoder", SEG, Bert=_mlen, XLNet=_mha,
     Albert=dict(_mlen, embedding_dim=8),
     Electra=dict(vocab_size=V, num_layers=1, num_heads=2, hidden_dim=16,
                  embedding_dim=8, intermediate_dim=32, max_sequence_length=16))
_add("encoder", _text("token_ids", "segment_ids"),
     FNet=dict(_dec, intermediate_dim=32, max_sequence_length=16),
     RoformerV2=dict(_mha, head_size=8))
_add("encoder", TOK, DistilBert=_mlen, Roberta=_mlen, XLMRoberta=_mlen,
     DebertaV3=dict(_mlen, bucket_size=8))
_add("encoder", _text("token_ids"), ESM=_mha)
_add("encdec", ENCDEC, Bart=_mlen, T5=_mha, T5Gemma=_t5gemma,
     T5Gemma2=_t5gemma)
_add("encdec", {k: (v[0], "bool" if "mask" in k else v[1])
                for k, v in ENCDEC.items()},
     EdRec=dict(vocab_size=V, num_layers_enc=1, num_layers_dec=1,
                hidden_dim=16, intermediate_dim=32, num_heads=2))
_add("encdec", {"encoder_features": ((16, 8), "rand"),
                **_text("token_ids", "padding_mask", prefix="decoder_")},
     Whisper=dict(_mha, num_mels=8, max_encoder_sequence_length=16,
                  max_decoder_sequence_length=16))
_add("encdec", {"encoder_input_values": ((1600, 1), "rand"),
                "encoder_padding_mask": ((1600,), "bool"),
                **_text("token_ids", "padding_mask", mask="bool",
                        prefix="decoder_")},
     Moonshine=dict(vocabulary_size=V, filter_dim=16, encoder_num_layers=1,
                    decoder_num_layers=1, hidden_dim=16, intermediate_dim=32,
                    encoder_num_heads=2, decoder_num_heads=2))
_add("conv", IMG, ResNet=_resnet, HGNetV2=_hgnetv2,
     CSPNet=dict(
         stem_filters=8, stem_kernel_size=3, stem_strides=1,
         stackwise_depth=[1, 1], stackwise_strides=2,
         stackwise_num_filters=[8, 16], block_type="dark_block",
         stage_type="csp", down_growth=True, stem_padding="same",
         bottle_ratio=(0.5, 1.0), block_ratio=(1.0, 0.5),
         expand_ratio=(2.0, 1.0)),
     DenseNet=dict(stackwise_num_repeats=[1, 1], growth_rate=4),
     EfficientNet=dict(
         stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
         stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16],
         stackwise_expansion_ratios=[1, 2], stackwise_strides=[1, 2],
         stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
         stackwise_block_types=["fused", "unfused"],
         stackwise_force_input_filters=[0, 0],
         stackwise_nores_option=[False, False], num_features=32,
         width_coefficient=1.0, depth_coefficient=1.0),
     MobileNet=dict(
         stackwise_expansion=[[16], [24]], stackwise_num_blocks=[1, 1],
         stackwise_num_filters=[[8], [16]], stackwise_kernel_size=[[3], [3]],
         stackwise_num_strides=[[2], [2]], stackwise_se_ratio=[[None], [.25]],
         stackwise_activation=[["relu"], ["hard_swish"], ["hard_swish"]],
         stackwise_padding=[[1], [1]], output_num_filters=32,
         depthwise_filters=8, depthwise_stride=2, depthwise_residual=False,
         last_layer_filter=32, input_num_filters=8),
     MobileNetV5=dict(
         _mnv5, **_shape, stem_size=8, num_features=32, use_msfa=False),
     VGG=dict(stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16]),
     Xception=dict(stackwise_conv_filters=[[8, 16], [32, 32], [32, 32]],
                   stackwise_pooling=[False, True, False]),
     BASNet=lambda: dict(image_encoder=_sub("ResNet", _resnet),
                         num_classes=1, projection_filters=8),
     DeepLabV3=lambda: dict(
         _shape, image_encoder=_sub("ResNet", _resnet3),
         low_level_feature_key="P2", spatial_pyramid_pooling_key="P4",
         dilation_rates=[2, 4], upsampling_size=4, projection_filters=8),
     RetinaNet=lambda: dict(image_encoder=_sub("ResNet", _resnet),
                            min_level=3, max_level=5, use_p5=True))
_add("vit", {"images": IMG}, DINOV2=_dinov2)
_add("vit", {"pixel_values": IMG}, DINOV3=dict(
    _vit, **_shape, patch_size=8, intermediate_dim=32, num_register_tokens=1))
_add("vit", IMG, MiT=_mit,
     ViT=dict(_vit, **_shape, patch_size=8, mlp_dim=32),
     DeiT=dict(_vit, **_shape, patch_size=8, intermediate_dim=32),
     SwinTransformer=dict(_shape, embed_dim=16, depths=(1, 1),
                          num_heads=(2, 2), window_size=4, drop_path=0.0),
     ViTDet=dict(_shape, hidden_size=16, num_layers=1, intermediate_dim=32,
                 num_heads=2, global_attention_layer_indices=[0],
                 patch_size=8, num_output_channels=8, window_size=2),
     SegFormer=lambda: dict(image_encoder=_sub("MiT", _mit),
                            projection_filters=8),
     DepthAnything=lambda: dict(
         image_encoder=_sub("DINOV2", _dinov2, num_layers=4, patch_size=4,
                            apply_layernorm=True),
         reassemble_factors=[4, 2, 1, 0.5], neck_hidden_dims=[8] * 4,
         fusion_hidden_dim=8, head_hidden_dim=8, head_in_index=-1,
         feature_keys=["stage1", "stage2", "stage3", "stage4"]),
     DFine=lambda: dict(
         _shape, backbone=_sub("HGNetV2", _hgnetv2,
                               out_features=["stage1", "stage2"]),
         decoder_in_channels=[16, 16], encoder_hidden_dim=16,
         num_denoising=0, num_labels=NUM_CLASSES, hidden_dim=16,
         learn_initial_query=False, num_queries=8,
         anchor_image_size=(HW, HW), feat_strides=[4, 8],
         num_feature_levels=2, encoder_in_channels=[16, 32],
         encode_proj_layers=[1], num_attention_heads=2, encoder_ffn_dim=32,
         num_encoder_layers=1, hidden_expansion=0.5, depth_multiplier=0.5,
         eval_idx=-1, num_decoder_layers=1, decoder_attention_heads=2,
         decoder_ffn_dim=32, decoder_n_points=[2, 2], lqe_hidden_dim=8,
         num_lqe_layers=1, out_features=["stage1", "stage2"], seed=0))
_add("vit", ((2, 16, 16, 3), "rand"), VideoPrism=dict(
    num_frames=2, patch_size=8, hidden_dim=16, intermediate_dim=32,
    num_heads=2, num_spatial_layers=1, num_temporal_layers=1,
    num_auxiliary_layers=0, image_shape=(16, 16, 3)))
_add("vit", {"images": _img(16, 16), "points": ((1, 2), "rand"),
             "labels": ((1,), "rand"), "boxes": ((1, 2, 2), "rand"),
             "masks": ((0, 16, 16, 1), "rand")}, SAM=_sam)
_add("multimodal", {"images": IMG, **_text("token_ids")},
     CLIP=lambda: _towers("CLIP"), MetaCLIP2=lambda: _towers("MetaCLIP2"),
     SigLIP=lambda: _towers("SigLIP"))
_add("multimodal", {"images": IMG, **TOK}, BLIP2=_blip2)
_add("multimodal", {"images": IMG, **ENCDEC}, **{"BLIP2/T5": lambda: _blip2(
    t5=True)})  # BLIP2Seq2SeqLM's: on Flan-T5 rather than OPT
_add("multimodal", {"images": _img(16, 32), **TOK}, PARSeq=lambda: dict(
    image_encoder=keras_hub.models.ViTBackbone(
        image_shape=(16, 32, 3), patch_size=(4, 8), mlp_dim=32,
        use_class_token=False, **_vit),
    vocabulary_size=V, max_label_length=S, decoder_hidden_dim=16,
    num_decoder_layers=1, num_decoder_heads=2, decoder_mlp_dim=32))
_add("multimodal", {"images": _img(16, 16), **TOK,
                    "response_mask": ((S,), "zeros")}, PaliGemma=dict(
    _llama, head_dim=8, image_size=16, vit_patch_size=4, vit_num_layers=1,
    vit_num_heads=2, vit_hidden_dim=8, vit_intermediate_dim=16))
_add("multimodal", {"pixel_values": _img(28, 28),
                    **_text("token_ids", "padding_mask", mask="bool"),
                    "boxes": ((1, 5), "rand"), "box_labels": ((1,), "ones")},
     SAM3PromptableConcept=_sam3)
# fmt: on

_SKIPPED = {
    "StableDiffusion3Backbone": "a diffusion pipeline (MMDiT, VAE and"
    " CLIP/T5 towers); left out on purpose",
    "FluxBackbone": "a diffusion transformer whose only task generates from"
    " text through a preprocessor; left out with Stable Diffusion 3",
    "FluxTextToImage": "its backbone is skipped",
    "Gemma4AssistantCausalLM": "a speculative-decoding draft model: it builds"
    " but its call() raises NotImplementedError by design",
}

# -- Tasks ---------------------------------------------------------------------

_TASK_KWARGS = {
    "MobileNetImageClassifier": lambda: dict(num_features=16),
    "VGGImageClassifier": lambda: dict(pooling_hidden_dim=16),
    "MobileNetV5ImageClassifier": lambda: dict(head_hidden_size=16),
    "HGNetV2ImageClassifier": lambda: dict(head_filters=16),
    "DepthAnythingDepthEstimator": lambda: dict(
        depth_estimation_type="relative"
    ),
    # Its __init__ reads token ids from the tokenizer, which has a built-in
    # character vocabulary (no download).
    "PARSeqCausalLM": lambda: dict(
        preprocessor=keras_hub.models.PARSeqCausalLMPreprocessor(
            tokenizer=keras_hub.tokenizers.PARSeqTokenizer(max_label_length=S),
            sequence_length=S,
        )
    ),
}
_TASK_BACKBONE = {"BLIP2Seq2SeqLM": "BLIP2/T5Backbone"}


def _mixed_failure(name):
    """Why keras-hub 0.32 fails under mixed_float16 and mixed_bfloat16."""
    if name.endswith(("MaskedLM", "MaskedPLM")) and "Roformer" not in name:
        return "MaskedLMHead adds its float32 bias to the float16 logits"
    if name.startswith("Moonshine"):
        return "MoonshineEncoderBlock adds float32 attention to float16"
    if name.startswith("SAM") and not name.startswith("SAM3"):
        return "SAMPromptEncoder multiplies float16 points by float32"
    return ""


_NOTES = {
    "SAM3PromptableConceptBackbone": "batch sizes above 2 fail in keras-hub"
    " (SAM3Attention broadcasts its mask wrongly)",
    "PARSeqCausalLM": "built with its character tokenizer (no download);"
    " no targets: its loss needs the preprocessor's sample weights",
    "BASNetBackbone": "1.2M parameters: its width is 8x the ResNet stem's",
    "RetinaNetObjectDetector": "6.7M parameters: 256-filter heads, fixed",
}
_QUICK = {
    "GPT2Backbone",  # decoder, learned positions
    "LlamaCausalLM",  # decoder, rotary, grouped-query attention, RMSNorm
    "GemmaCausalLM",  # decoder, tied embeddings
    "BertTextClassifier",  # encoder, its graph slices with x[:, 0, :]
    "BartSeq2SeqLM",  # encoder-decoder
    "ResNetImageClassifier",  # conv net, batch norm
    "EfficientNetImageClassifier",  # conv net, depthwise, squeeze-excite
    "ViTImageClassifier",  # vision transformer
    "DeepLabV3ImageSegmenter",  # conv net, dense output
    "CLIPBackbone",  # image and text towers
}


def _public(accept):
    """{name: (class, aliases)} of keras_hub.models classes `accept` takes."""
    found = {}
    for name in sorted(dir(keras_hub.models)):
        obj = getattr(keras_hub.models, name)
        if inspect.isclass(obj) and accept(name, obj):
            found.setdefault(obj, []).append(name)
    out = {}
    for cls, names in found.items():
        main = cls.__name__ if cls.__name__ in names else names[0]
        out[main] = (cls, [n for n in names if n != main])
    return out


def _params(cls):
    return inspect.signature(cls.__init__).parameters


def _build_backbone(key):
    kwargs = _BACKBONES[key][1]
    base = key.split("/")[0].removesuffix("Backbone")  # "BLIP2/T5Backbone"
    cls = getattr(keras_hub.models, base + "Backbone")
    return cls(**(kwargs() if callable(kwargs) else kwargs))


def _build_task(cls, key):
    kwargs = _TASK_KWARGS.get(cls.__name__, dict)()
    for name, value in (("num_classes", NUM_CLASSES), ("preprocessor", None)):
        if name in _params(cls):
            kwargs.setdefault(name, value)
    task = cls(backbone=_build_backbone(key), **kwargs)
    task.preprocessor = None  # fit() must not preprocess our tensors
    return task


def _task_io(cls, spec):
    """(inputs spec, targets spec or None) of a task on a backbone spec."""
    m = keras_hub.models
    if issubclass(cls, m.MaskedLM) or cls.__name__.endswith("MaskedPLM"):
        return dict(spec, mask_positions=((MASKED,), "pos")), ((MASKED,), "ids")
    if cls.__name__ == "PARSeqCausalLM":
        return spec, None  # its loss needs the preprocessor's sample weights
    if "decoder_token_ids" in spec:  # Seq2SeqLM and AudioToText
        return spec, spec["decoder_token_ids"]
    if issubclass(cls, m.CausalLM):
        return spec, spec["token_ids"]
    if issubclass(cls, (m.Classifier, m.ImageClassifier)):
        return spec, ((), "cls")
    if issubclass(cls, m.ImageSegmenter) and "num_classes" in _params(cls):
        return spec, ((*spec[0][:2], NUM_CLASSES), "onehot")
    return spec, None


def _case(name, kind, build, spec, target, family, aliases):
    inputs = lambda batch: _feed(spec, batch)  # noqa: E731
    targets = target and (lambda batch: _feed(target, batch, seed=1))
    notes = [_NOTES.get(name.replace("ImageSegmenter", "Backbone"), "")]
    notes += [f"aliases: {', '.join(aliases)}"] if aliases else []
    notes = "; ".join(filter(None, notes))
    return Case(name, kind, build, inputs, targets, notes, family,
                name in _QUICK, _mixed_failure(name))  # fmt: skip


def _is_backbone(name, cls):  # but not a base class
    bases = ("Backbone", "FeaturePyramidBackbone")
    is_backbone = issubclass(cls, keras_hub.models.Backbone)
    return is_backbone and name.endswith("Backbone") and name not in bases


def _is_task(name, cls):  # but not a base class such as CausalLM
    is_task = issubclass(cls, keras_hub.models.Task)
    return is_task and getattr(cls, "backbone_cls", None) is not None


def _catalog():
    cases, skipped = [], {}
    for name, (_, aliases) in _public(_is_backbone).items():
        if name not in _BACKBONES:
            skipped[name] = _SKIPPED.get(name, "no tiny config in the zoo")
            continue
        family, _, spec = _BACKBONES[name]
        build = lambda key=name: _build_backbone(key)  # noqa: E731
        cases.append(
            _case(name, "backbone", build, spec, None, family, aliases)
        )
    for name, (cls, aliases) in _public(_is_task).items():
        key = _TASK_BACKBONE.get(name, cls.backbone_cls.__name__)
        if name in _SKIPPED or key not in _BACKBONES:
            skipped[name] = _SKIPPED.get(name, "its backbone is skipped")
            continue
        if name == "PARSeqCausalLM" and not find_spec("tensorflow_text"):
            skipped[name] = "its tokenizer needs tensorflow-text"
            continue
        family, _, spec = _BACKBONES[key]
        spec, target = _task_io(cls, spec)
        build = lambda cls=cls, key=key: _build_task(cls, key)  # noqa: E731
        cases.append(_case(name, "task", build, spec, target, family, aliases))
    return cases, skipped


def cases():
    """Every model the zoo builds, as `Case`s (nothing is built here)."""
    return _catalog()[0]


def skipped():
    """{class name: reason} for the public classes the zoo does not build."""
    return _catalog()[1]


# -- Compiled, trained tasks ---------------------------------------------------
# The tasks users fine-tune, one of each kind: compiled with an optimizer of
# the user's (and the task's own loss and metrics), then fit a few steps.
TRAINED = ("GPT2CausalLM", "BertTextClassifier", "ResNetImageClassifier")


def trained_task(name, optimizer, batch=4, steps=2):
    """(case, task): the zoo's task `name` compiled with `optimizer` and
    trained for `steps` batches of `batch`, as a user fine-tunes one."""
    case = next(case for case in cases() if case.name == name)
    task = case.build()
    task.compile(optimizer=optimizer)
    size = batch * steps
    task.fit(case.inputs(size), case.targets(size), batch_size=batch, verbose=0)
    return case, task


# -- Runner --------------------------------------------------------------------


def is_functional(model):
    return isinstance(model, keras.src.models.functional.Functional)


def raw_ops(model):
    """Class names of the non-Layer operations in a Functional graph."""
    found = []
    for op in getattr(model, "_operations", []):
        if is_functional(op):
            found += raw_ops(op)
        elif not isinstance(op, keras.layers.Layer):
            found.append(type(op).__name__)
    return found


def run(case, batch=2, loss=False):
    """Builds and calls one case; returns a dict of what happened."""
    row = dict(name=case.name, kind=case.kind, functional=None, params=0)
    start = time.perf_counter()
    try:
        model = case.build()
        row["build_s"] = time.perf_counter() - start
        row["functional"] = is_functional(model)
        row["params"] = model.count_params()
        row["raw_ops"] = sorted(set(raw_ops(model)))
        keras.tree.map_structure(np.asarray, model(case.inputs(batch)))
        if loss and case.targets:
            x, y = case.inputs(batch), case.targets(batch)
            row["loss"] = model.evaluate(x, y, batch_size=batch, verbose=0)
        row["ok"] = "ok"
    except Exception as e:  # reported, not hidden
        message = (str(e).strip().splitlines() or [""])[0]
        row["ok"] = f"{type(e).__name__}: {message[:160]}"
    row["total_s"] = time.perf_counter() - start
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--only", default="", help="NAME,NAME,...")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loss", action="store_true", help="evaluate(x, y)")
    args = parser.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    chosen = [
        case
        for case in cases()
        if (case.name in only if only else case.quick or not args.quick)
    ]
    start, failed = time.perf_counter(), 0
    for case in chosen:
        keras.config.set_dtype_policy(args.policy)
        row = run(case, loss=args.loss)
        failed += row["ok"] != "ok"
        kind = {True: "F", False: "S", None: "?"}[row["functional"]]
        ops = "ops=" + ",".join(row["raw_ops"]) if row.get("raw_ops") else ""
        print(
            f"{case.name:36.36} {case.kind:8} {kind} {row['params']:>8} "
            f"{row.get('build_s', 0):5.1f}s {row['total_s']:5.1f}s "
            f"{row['ok']} {row.get('loss', '')} {ops}".rstrip(),
            flush=True,
        )
    seconds = time.perf_counter() - start
    print(f"{len(chosen) - failed} passed, {failed} failed")
    print(f"{len(chosen)} cases in {seconds:.0f}s under {args.policy}")
    keras.config.set_dtype_policy("float32")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
