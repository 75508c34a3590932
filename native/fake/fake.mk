# Fake NCCL, CUDA driver and runtime, and cuBLAS for CPU-only tests. Included by native/Makefile, or standalone:
#   make -C native -f fake/fake.mk -f workload/workload.mk all-fake
# Paths are relative to native/; BUILD is the output directory, CFLAGS_COMMON the shared flags.
BUILD ?= build
CC ?= cc
FAKE_CFLAGS = $(or $(CFLAGS_COMMON),-O2 -Wall -Wextra -Werror) -std=c11 -fPIC -fvisibility=hidden \
              -D_GNU_SOURCE -Iinclude -Ifake
FAKE_DIR := $(BUILD)/fake
FAKE_COMMON_SRC := fake/fk_faults.c
FAKE_NCCL_SRC := fake/nccl_shm.c fake/nccl_model.c fake/nccl_comm.c fake/nccl_coll.c fake/nccl_device.c \
                 fake/nccl_prof.c fake/nccl_prof_host.c fake/nccl_prof_dev.c $(FAKE_COMMON_SRC)
FAKE_CUDA_SRC := fake/gpu.c fake/cuda_drv.c $(FAKE_COMMON_SRC)
FAKE_CUDART_SRC := fake/cudart.c
FAKE_HDRS := include/nccl_abi.h include/nccl_profiler_abi.h fake/nccl_prof.h fake/nccl_fake.h fake/fk_faults.h fake/fk_time.h fake/cuda_fake.h fake/gpu.h \
             fake/fk_pci.h
# The fake device lives in the fake driver, libcuda.so.1, as a GPU sits behind CUDA's driver; the
# runtime (libcudart.so.12, or compiled into a program: a static runtime), NCCL and cuBLAS put
# their work on it through there. Real NCCL and cuBLAS carry their own static runtime and reach the
# driver; one shared driver is what makes one device per process here.
FAKE_USE_CUDA := -L$(FAKE_DIR) -l:libcuda.so.1 -Wl,-rpath,'$$ORIGIN' -Wl,--enable-new-dtags

.PHONY: all-fake clean-fake
all-fake: $(FAKE_DIR)/libnccl.so $(FAKE_DIR)/libcudart.so $(FAKE_DIR)/libcublas.so $(FAKE_DIR)/libnvidia-ml.so.1 \
          $(FAKE_DIR)/libcuda.so.1

$(FAKE_DIR)/libcuda.so.1: $(FAKE_CUDA_SRC) $(FAKE_HDRS)
	@mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -shared -Wl,-soname,libcuda.so.1 -o $@ $(FAKE_CUDA_SRC) -lpthread

$(FAKE_DIR)/libnccl.so.2: $(FAKE_NCCL_SRC) $(FAKE_HDRS) $(FAKE_DIR)/libcuda.so.1
	@mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -shared -Wl,-soname,libnccl.so.2 -o $@ $(FAKE_NCCL_SRC) $(FAKE_USE_CUDA) -lpthread -ldl

$(FAKE_DIR)/libcudart.so.12: $(FAKE_CUDART_SRC) $(FAKE_HDRS) $(FAKE_DIR)/libcuda.so.1
	@mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -shared -Wl,-soname,libcudart.so.12 -o $@ $(FAKE_CUDART_SRC) $(FAKE_USE_CUDA) -lpthread

$(FAKE_DIR)/libcublas.so.12: fake/cublas.c $(FAKE_HDRS) $(FAKE_DIR)/libcuda.so.1
	@mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -shared -Wl,-soname,libcublas.so.12 -o $@ fake/cublas.c $(FAKE_USE_CUDA) -lpthread

# The fake NVML: loaded by the node agent (pynvml looks for libnvidia-ml.so.1), not the job.
$(FAKE_DIR)/libnvidia-ml.so.1: fake/nvml.c $(FAKE_COMMON_SRC) $(FAKE_HDRS)
	@mkdir -p $(@D)
	$(CC) $(FAKE_CFLAGS) -shared -Wl,-soname,libnvidia-ml.so.1 -o $@ fake/nvml.c $(FAKE_COMMON_SRC) -lpthread

$(FAKE_DIR)/%.so: $(FAKE_DIR)/%.so.2
	ln -sf $(<F) $@
$(FAKE_DIR)/%.so: $(FAKE_DIR)/%.so.12
	ln -sf $(<F) $@

clean-fake:
	rm -rf $(FAKE_DIR)
