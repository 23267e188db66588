"""A diffusers pipeline folder and a captioned image folder in, encoded shards out (and back to a pipeline).

::

    folder.py    read_pipeline(DIR): model_index.json, backbone (unet/ | transformer/), vae/, text encoders,
                 tokenizers, scheduler/; the configs' identity (hashes)
    images.py    captioned images (metadata.jsonl or NAME.txt), resized + center-cropped, optional flip
    encode.py    the frozen VAE and text encoder under torch.no_grad: latents, encoder_hidden_states, masks
    shards.py    the cache folder: manifest.json + shard-NNNNN/ (written atomically, resumable), and the
                 ``LatentSource`` training reads it through

The commands over them: ``pulse_torch.cache_latents`` and ``pulse_torch.export``.
"""
