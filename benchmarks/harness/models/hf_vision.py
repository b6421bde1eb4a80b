"""The sweeps' Hugging Face vision models: ViTs, CNNs and hybrids from small configs."""

from __future__ import annotations

from benchmarks.harness.models.hf_text import OMIT, hf
from benchmarks.harness.models.spec import Kwargs, Spec

__all__ = ["VISION", "hf_vision_specs"]

VISION: Kwargs = dict(
    image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, num_labels=10,
)  # fmt: skip
#: an override that removes a key of the base config (a config that has no such setting).


def hf_vision_specs() -> list[Spec]:
    """Every vision model of the registry from transformers."""
    v, fam = VISION, "hf-vision"
    #: configs that take lists of widths and depths: the transformer keys of VISION removed
    cnn = {k: OMIT for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                             "intermediate_size", "patch_size")}  # fmt: skip
    cnn4 = dict(cnn, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1])
    three = dict(cnn, num_heads=[1, 2, 3], depth=[1, 2, 3])  # cvt indexes stage j with j < depth
    table: list[tuple[str, str, Kwargs]] = [
        ("vit", "vit", {}),
        ("deit", "deit", dict(architectures=["DeiTForImageClassification"])),
        ("beit", "beit", dict(use_relative_position_bias=True)),
        ("data2vec-vision", "data2vec-vision", dict(use_relative_position_bias=True)),
        ("dinov2", "dinov2", {}),
        ("dinov2_with_registers", "dinov2_with_registers", dict(num_register_tokens=2)),
        ("vit_msn", "vit_msn", {}),
        (
            "swin",
            "swin",
            dict(cnn, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
        ),
        (
            "swinv2",
            "swinv2",
            dict(cnn, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
        ),
        ("convnext", "convnext", cnn4),
        ("convnextv2", "convnextv2", cnn4),
        ("resnet", "resnet", dict(cnn4, embedding_size=8, layer_type="bottleneck")),
        ("regnet", "regnet", dict(cnn4, embedding_size=8, groups_width=8)),
        (
            "bit",
            "bit",
            dict(
                cnn4,
                embedding_size=8,
                global_padding="SAME",
                layer_type="bottleneck",
                num_groups=4,
            ),
        ),
        ("poolformer", "poolformer", cnn4),
        ("mobilenet_v2", "mobilenet_v2", dict(cnn, depth_multiplier=0.35)),
        ("mobilenet_v1", "mobilenet_v1", dict(cnn, depth_multiplier=0.25)),
        (
            "efficientnet",
            "efficientnet",
            dict(cnn, width_coefficient=0.25, hidden_dim=320, depth_coefficient=0.25),
        ),
        (
            "levit",
            "levit",
            dict(
                cnn,
                image_size=64,
                hidden_sizes=[16, 32, 48],
                architectures=["LevitForImageClassification"],
                num_attention_heads=[1, 2, 3],
                depths=[1, 1, 1],
                key_dim=[8, 8, 8],
                patch_size=16,
            ),
        ),
        (
            "cvt",
            "cvt",
            dict(
                three,
                embed_dim=[16, 32, 48],
                patch_sizes=[7, 3, 3],
                patch_stride=[4, 2, 2],
                patch_padding=[2, 1, 1],
                mlp_ratio=[2.0] * 3,
                qkv_bias=[True] * 3,
                cls_token=[False, False, True],
                stride_kv=[2] * 3,
                padding_kv=[1] * 3,
                kernel_qkv=[3] * 3,
                padding_q=[1] * 3,
                stride_q=[1] * 3,
                drop_path_rate=[0.0] * 3,
                drop_rate=[0.0] * 3,
                attention_drop_rate=[0.0] * 3,
            ),
        ),
        (
            "focalnet",
            "focalnet",
            dict(
                cnn,
                embed_dim=16,
                depths=[1, 1],
                focal_levels=[2, 2],
                focal_windows=[3, 3],
                patch_size=4,
            ),
        ),
        (
            "pvt",
            "pvt",
            dict(
                num_encoder_blocks=2,
                depths=[1, 1],
                sequence_reduction_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[4, 2],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
            ),
        ),
        (
            "pvt_v2",
            "pvt_v2",
            dict(
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[7, 3],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
            ),
        ),
        (
            "segformer",
            "segformer",
            dict(
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[7, 3],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
                decoder_hidden_size=32,
            ),
        ),
        (
            "mobilevit",
            "mobilevit",
            dict(
                cnn,
                image_size=64,
                hidden_sizes=[16, 24, 32],
                neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
            ),
        ),
        ("mobilevitv2", "mobilevitv2", dict(cnn, image_size=64, width_multiplier=0.25)),
        ("swiftformer", "swiftformer", dict(cnn, depths=[1, 1, 1, 1], embed_dims=[8, 16, 24, 32])),
        (
            "hiera",
            "hiera",
            dict(
                cnn,
                image_size=[64, 64],
                embed_dim=16,
                num_heads=[1, 2, 4, 8],
                depths=[1, 1, 1, 1],
                query_stride=[2, 2],
                masked_unit_size=[8, 8],
            ),
        ),
        ("ijepa", "ijepa", {}),
        ("siglip_vision", "siglip_vision_model", {}),
        ("clip_vision", "clip_vision_model", {}),
    ]
    specs = []
    for name, model_type, over in table:
        size = over.get("image_size", 32)
        size = 64 if isinstance(size, list) else int(size)
        head = "base" if model_type in ("siglip_vision_model", "clip_vision_model") else "image"
        specs.append(Spec(name, fam, hf(model_type, head, v, f"image:{size}", **over)))
    return specs
