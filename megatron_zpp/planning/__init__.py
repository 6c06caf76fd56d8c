"""megatron_zpp/planning"""
