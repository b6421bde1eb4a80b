"""The sweeps' vision models from timm and torchvision (no pretrained weights)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.models.spec import BATCH, Built, Kwargs, Spec, images, video

__all__ = ["TIMM", "TORCHVISION", "timm_specs", "torchvision_specs"]


def timm_model(name: str, size: int = 64, batch: int = BATCH, **kwargs: Any) -> Any:
    """A builder for ``timm.create_model(name, pretrained=False, num_classes=10, ...)``."""

    def build() -> Built:
        import timm

        base = dict(pretrained=False, num_classes=10, **kwargs)
        for extra in ({"drop_rate": 0.0, "drop_path_rate": 0.0}, {"drop_rate": 0.0}, {}):
            try:
                model = timm.create_model(name, **base, **extra)
                break
            except TypeError:
                if not extra:
                    raise
        return model, images(size, batch), {}

    return build


TIMM: list[tuple[str, Kwargs]] = [
    # ResNets and relatives
    ("resnet18", {}), ("resnet26d", {}), ("resnet50", dict(batch=4)), ("resnet10t", {}),
    ("resnetv2_18", {}), ("resnetv2_50", dict(batch=4)), ("resnetv2_50x1_bit", dict(batch=4)),
    ("resnext26ts", {}), ("seresnext26d_32x4d", dict(batch=4)), ("ecaresnet26t", {}),
    ("skresnet18", {}), ("res2net50_14w_8s", dict(batch=4)), ("res2next50", dict(batch=4)),
    ("resnest14d", {}), ("resnest26d", dict(batch=4)), ("legacy_seresnet18", {}),
    ("nf_resnet26", {}), ("gcresnet33ts", {}),
    ("lambda_resnet26t", {}),
    ("botnet26t_256", dict(size=64, img_size=64)),
    ("test_resnet", {}), ("test_byobnet", {}), ("test_nfnet", {}),
    # re-parameterisable
    ("repvgg_a0", {}), ("mobileone_s0", {}), ("fastvit_t8", {}), ("repghostnet_050", {}),
    ("repvit_m1", {}),
    # mobile / efficient CNNs
    ("efficientnet_b0", {}), ("efficientnet_lite0", {}), ("tf_efficientnet_b0", {}),
    ("efficientnetv2_rw_t", {}), ("efficientnet_b0_gn", {}), ("mobilenetv3_small_050", {}),
    ("mobilenetv3_large_100", {}), ("mobilenetv2_050", {}), ("mnasnet_small", {}),
    ("fbnetc_100", {}), ("ghostnet_100", {}), ("ghostnetv2_100", {}), ("hardcorenas_a", {}),
    ("lcnet_050", {}), ("tinynet_e", {}), ("mixnet_s", {}), ("rexnet_100", {}),
    ("test_efficientnet", {}), ("test_efficientnet_evos", {}), ("test_efficientnet_ln", {}),
    # RegNet and other CNN families
    ("regnetx_002", {}), ("regnety_002", {}), ("regnetz_005", {}), ("dla34", {}),
    ("dla46_c", {}), ("dpn48b", {}), ("densenet121", dict(batch=4)),
    ("cspresnet50", dict(batch=4)),
    ("cspdarknet53", dict(batch=4)), ("cs3darknet_focus_s", {}), ("ese_vovnet19b_dw", {}),
    ("hrnet_w18_small", {}), ("selecsls42b", {}), ("gernet_s", {}),
    ("inception_v3", dict(size=75, batch=4)),
    ("hgnetv2_b0", {}), ("hgnet_tiny", {}), ("starnet_s1", {}), ("rdnet_tiny", dict(batch=4)),
    ("fasternet_t0", {}), ("darknet17", {}), ("vgg11", dict(size=32, batch=4)),
    # ConvNeXt and MetaFormers
    ("convnext_atto", {}), ("convnextv2_atto", {}), ("test_convnext", {}),
    ("poolformer_s12", {}), ("poolformerv2_s12", {}), ("caformer_s18", dict(batch=4)),
    ("inception_next_tiny", dict(batch=4)), ("mambaout_femto", {}), ("test_mambaout", {}),
    # ViT family
    ("vit_tiny_patch16_224", dict(img_size=64)), ("deit_tiny_patch16_224", dict(img_size=64)),
    ("deit_tiny_distilled_patch16_224", dict(img_size=64)),
    ("cait_xxs24_224", dict(img_size=64, depth=4)), ("xcit_nano_12_p16_224", dict(img_size=64)),
    ("pit_ti_224", dict(img_size=64)), ("eva02_tiny_patch14_224", dict(size=56, img_size=56)),
    ("vit_small_patch16_rope_224", dict(img_size=64, depth=4)),
    ("vit_little_patch16_reg4_gap_256", dict(img_size=64, depth=4)),
    ("beit_base_patch16_224", dict(img_size=64, depth=2, batch=4)),
    ("convit_tiny", dict(img_size=64)), ("test_vit", {}), ("test_vit2", {}),
    ("test_vit3", dict(img_size=64)), ("test_vit_relpos", dict(img_size=64)),
    ("mixer_s16_224", dict(img_size=64)),
    ("resmlp_12_224", dict(img_size=64)), ("gmlp_ti16_224", dict(img_size=64)),
    ("volo_d1_224", dict(img_size=64, batch=4)), ("visformer_tiny", dict(img_size=64)),
    # hierarchical / windowed attention
    ("swin_tiny_patch4_window7_224", dict(img_size=64, window_size=2, batch=4)),
    ("swinv2_cr_tiny_ns_224", dict(img_size=64, window_size=2, batch=4)),
    ("swinv2_tiny_window8_256", dict(img_size=64, window_size=2, batch=4)),
    ("davit_tiny", dict(batch=4)), ("focalnet_tiny_srf", dict(batch=4)),
    ("hiera_tiny_224", dict(img_size=64)), ("mvitv2_tiny", dict(img_size=64, batch=4)),
    ("pvt_v2_b0", {}), ("twins_pcpvt_small", dict(batch=4)), ("coat_lite_tiny", dict(img_size=64)),
    ("levit_128s", dict(img_size=64)), ("efficientvit_b0", {}), ("efficientvit_m0", {}),
    ("efficientformerv2_s0", dict(img_size=64)), ("tiny_vit_5m_224", {}),
    ("edgenext_xx_small", {}),
    ("mobilevit_xxs", {}), ("mobilevitv2_050", {}), ("nextvit_small", dict(batch=4)),
    # attention hybrids
    ("coatnet_nano_rw_224", dict(img_size=64)), ("coatnet_0_rw_224", dict(img_size=64, batch=4)),
    ("maxvit_rmlp_pico_rw_256", dict(img_size=64)), ("test_maxvit", dict(size=160, batch=4)),
    ("test_coatnet", dict(size=160, batch=4)),
    ("crossvit_tiny_240", dict(size=240, batch=2)), ("sequencer2d_s", dict(batch=4)),
]  # fmt: skip


def timm_specs() -> list[Spec]:
    """Every timm model of the registry."""
    specs = []
    for name, over in TIMM:
        options = dict(over)
        size, batch = int(options.pop("size", 64)), int(options.pop("batch", BATCH))
        specs.append(Spec(name, "timm", timm_model(name, size, batch, **options)))
    return specs


def tv_model(name: str, kind: str = "classify", size: int = 64, batch: int = BATCH,
             **kwargs: Any) -> Any:  # fmt: skip
    """A builder for ``torchvision.models.get_model(name, weights=None, ...)``."""

    def build() -> Built:
        import torchvision

        extra: Kwargs = dict(kwargs)
        if kind != "flow":
            extra.setdefault("num_classes", 10)
        if kind in ("segment", "detect"):
            extra.setdefault("weights_backbone", None)
        model = torchvision.models.get_model(name, weights=None, **extra)
        if kind == "video":
            return model, video(size, batch=batch), {}
        if kind == "flow":
            first, second = images(size, batch)[0], images(size, batch)[0].flip(0)
            return model, (first, second), {}
        return model, images(size, batch), {}

    return build


def small_mvit() -> Built:
    """torchvision's MViT-v2 code with four blocks, on 8 frames of 32 x 32 pixels."""
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    blocks = [
        MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
        MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2]),
        MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
        MSBlockConfig(4, 32, 64, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 1, 1]),
    ]
    model = MViT((32, 32), 8, blocks, residual_pool=True, residual_with_cls_embed=False,
                 rel_pos_embed=True, proj_after_attn=True, dropout=0.0,
                 num_classes=10)  # fmt: skip
    return model, video(32, 8, batch=4), {}


def small_maxvit() -> Built:
    """torchvision's MaxViT code at 64 x 64 pixels, partition size 2."""
    from torchvision.models.maxvit import MaxVit

    model = MaxVit((64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32],
                   block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0,
                   num_classes=10)  # fmt: skip
    return model, images(64), {}


def small_vit() -> Built:
    """torchvision's VisionTransformer code at 32 x 32 pixels, 2 layers of width 64."""
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(32, 8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                              num_classes=10)  # fmt: skip
    return model, images(32), {}


TORCHVISION: list[tuple[str, str, Kwargs]] = [
    ("alexnet", "classify", dict(batch=4)), ("vgg11_bn", "classify", dict(size=32, batch=4)),
    ("resnet18", "classify", {}), ("resnet50", "classify", dict(batch=4)),
    ("resnext50_32x4d", "classify", dict(batch=4)), ("wide_resnet50_2", "classify", dict(batch=4)),
    ("densenet121", "classify", dict(batch=4)), ("squeezenet1_0", "classify", {}),
    ("squeezenet1_1", "classify", {}),
    ("inception_v3", "classify", dict(size=75, batch=4, aux_logits=False, init_weights=True)),
    ("googlenet", "classify", dict(aux_logits=False, init_weights=True)),
    ("shufflenet_v2_x0_5", "classify", {}), ("mobilenet_v2", "classify", {}),
    ("mobilenet_v3_small", "classify", {}), ("mobilenet_v3_large", "classify", {}),
    ("mnasnet0_5", "classify", {}), ("efficientnet_b0", "classify", {}),
    ("efficientnet_v2_s", "classify", dict(batch=4)), ("regnet_x_400mf", "classify", {}),
    ("regnet_y_400mf", "classify", {}), ("convnext_tiny", "classify", dict(batch=4)),
    ("swin_t", "classify", dict(batch=4)), ("swin_v2_t", "classify", dict(batch=4)),
    ("r3d_18", "video", {}), ("mc3_18", "video", {}), ("r2plus1d_18", "video", {}),
    ("swin3d_t", "video", {}),
    ("fcn_resnet50", "segment", dict(batch=4)),
    ("deeplabv3_mobilenet_v3_large", "segment", {}), ("lraspp_mobilenet_v3_large", "segment", {}),
    ("deeplabv3_resnet50", "segment", dict(batch=4, aux_loss=True)),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "detect", dict(batch=2)),
    ("retinanet_resnet50_fpn", "detect", dict(batch=2)),
    ("ssdlite320_mobilenet_v3_large", "detect", dict(batch=2)),
    ("fcos_resnet50_fpn", "detect", dict(batch=2)),
    ("raft_small", "flow", dict(batch=2, size=128)),
]  # fmt: skip
TV_FAMILY = {"classify": "tv-classify", "video": "tv-video", "segment": "tv-segment",
             "detect": "tv-detect", "flow": "tv-flow"}  # fmt: skip


def torchvision_specs() -> list[Spec]:
    """Every torchvision model of the registry."""
    specs = []
    for name, kind, over in TORCHVISION:
        options = dict(over)
        size, batch = int(options.pop("size", 64)), int(options.pop("batch", BATCH))
        build = tv_model(name, kind, size, batch, **options)
        # RAFT builds its coordinate grids in the default dtype
        specs.append(Spec(f"tv-{name}", TV_FAMILY[kind], build, default_double=kind == "flow"))
    specs += [
        Spec("tv-vit_small", "tv-classify", small_vit),
        Spec("tv-maxvit_small", "tv-classify", small_maxvit),
        Spec("tv-mvit_v2_small", "tv-video", small_mvit),
    ]
    return specs
