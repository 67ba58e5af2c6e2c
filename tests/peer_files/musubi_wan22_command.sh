# Written for wantrain's tests (not a copy): the training command of musubi-tuner's docs/wan.md
# (kohya-ss/musubi-tuner, read 2026-12-04) with its Wan 2.2 task and files, as a user would paste it.
accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 src/musubi_tuner/wan_train_network.py \
    --task t2v-A14B \
    --dit /models/wan2.2_t2v_low_noise_14B_fp16.safetensors \
    --dit_high_noise /models/wan2.2_t2v_high_noise_14B_fp16.safetensors \
    --dataset_config musubi_dataset_video.toml --sdpa --mixed_precision bf16 --fp8_base \
    --optimizer_type adamw8bit --learning_rate 2e-4 --gradient_checkpointing \
    --max_data_loader_n_workers 2 --persistent_data_loader_workers \
    --network_module networks.lora_wan --network_dim 32 \
    --timestep_sampling shift --discrete_flow_shift 3.0 \
    --max_train_epochs 16 --save_every_n_epochs 1 --seed 42 \
    --output_dir /out --output_name name-of-lora
