// A Vulkan layer for the tests: counts the compute dispatches and pipeline barriers that command buffers record
// (vkCmdDispatch, vkCmdPipelineBarrier, vkCmdPipelineBarrier2), so that a test can read how many a decoded
// token costs (tests/test_vulkan.py). Everything else passes through. One instance and device at a time (the
// functions of the device created last: the test's processes see one Vulkan device).
// The counts are read with ott_vkcount_get() from the same library, which the loader has opened.
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#define EXPORT __attribute__((visibility("default")))

static PFN_vkGetInstanceProcAddr next_gipa;
static PFN_vkGetDeviceProcAddr next_gdpa;
static PFN_vkCmdDispatch next_dispatch;
static PFN_vkCmdPipelineBarrier next_barrier;
static PFN_vkCmdPipelineBarrier2 next_barrier2;
static atomic_llong n_dispatch, n_barrier;

EXPORT void ott_vkcount_get(int64_t * dispatches, int64_t * barriers) {
    *dispatches = atomic_load(&n_dispatch);
    *barriers = atomic_load(&n_barrier);
}

static VKAPI_ATTR void VKAPI_CALL count_dispatch(VkCommandBuffer cb, uint32_t x, uint32_t y, uint32_t z) {
    atomic_fetch_add(&n_dispatch, 1);
    next_dispatch(cb, x, y, z);
}

static VKAPI_ATTR void VKAPI_CALL count_barrier(VkCommandBuffer cb, VkPipelineStageFlags src, VkPipelineStageFlags dst,
        VkDependencyFlags dep, uint32_t nm, const VkMemoryBarrier * m, uint32_t nb, const VkBufferMemoryBarrier * b,
        uint32_t ni, const VkImageMemoryBarrier * im) {
    atomic_fetch_add(&n_barrier, 1);
    next_barrier(cb, src, dst, dep, nm, m, nb, b, ni, im);
}

static VKAPI_ATTR void VKAPI_CALL count_barrier2(VkCommandBuffer cb, const VkDependencyInfo * info) {
    atomic_fetch_add(&n_barrier, 1);
    next_barrier2(cb, info);
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_create_instance(const VkInstanceCreateInfo * ci,
        const VkAllocationCallbacks * alloc, VkInstance * inst) {
    VkLayerInstanceCreateInfo * link = (VkLayerInstanceCreateInfo *) ci->pNext;
    while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO && link->function == VK_LAYER_LINK_INFO)) {
        link = (VkLayerInstanceCreateInfo *) link->pNext;
    }
    if (!link) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    next_gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    link->u.pLayerInfo = link->u.pLayerInfo->pNext; // for the next layer
    PFN_vkCreateInstance create = (PFN_vkCreateInstance) next_gipa(VK_NULL_HANDLE, "vkCreateInstance");
    return create(ci, alloc, inst);
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_create_device(VkPhysicalDevice pd, const VkDeviceCreateInfo * ci,
        const VkAllocationCallbacks * alloc, VkDevice * dev) {
    VkLayerDeviceCreateInfo * link = (VkLayerDeviceCreateInfo *) ci->pNext;
    while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO && link->function == VK_LAYER_LINK_INFO)) {
        link = (VkLayerDeviceCreateInfo *) link->pNext;
    }
    if (!link) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    next_gdpa = link->u.pLayerInfo->pfnNextGetDeviceProcAddr;
    link->u.pLayerInfo = link->u.pLayerInfo->pNext;
    PFN_vkCreateDevice create = (PFN_vkCreateDevice) gipa(VK_NULL_HANDLE, "vkCreateDevice");
    VkResult r = create(pd, ci, alloc, dev);
    if (r == VK_SUCCESS) {
        next_dispatch = (PFN_vkCmdDispatch) next_gdpa(*dev, "vkCmdDispatch");
        next_barrier = (PFN_vkCmdPipelineBarrier) next_gdpa(*dev, "vkCmdPipelineBarrier");
        next_barrier2 = (PFN_vkCmdPipelineBarrier2) next_gdpa(*dev, "vkCmdPipelineBarrier2");
        if (!next_barrier2) {
            next_barrier2 = (PFN_vkCmdPipelineBarrier2) next_gdpa(*dev, "vkCmdPipelineBarrier2KHR");
        }
    }
    return r;
}

static PFN_vkVoidFunction layer_device_fn(const char * name) {
    if (!strcmp(name, "vkCmdDispatch")) {
        return (PFN_vkVoidFunction) count_dispatch;
    }
    if (!strcmp(name, "vkCmdPipelineBarrier")) {
        return (PFN_vkVoidFunction) count_barrier;
    }
    if (!strcmp(name, "vkCmdPipelineBarrier2") || !strcmp(name, "vkCmdPipelineBarrier2KHR")) {
        return next_barrier2 ? (PFN_vkVoidFunction) count_barrier2 : NULL;
    }
    return NULL;
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL ott_vkcount_GetDeviceProcAddr(VkDevice dev, const char * name) {
    PFN_vkVoidFunction f = layer_device_fn(name);
    if (f || !strcmp(name, "vkCmdPipelineBarrier2") || !strcmp(name, "vkCmdPipelineBarrier2KHR")) {
        return f;
    }
    if (!strcmp(name, "vkGetDeviceProcAddr")) {
        return (PFN_vkVoidFunction) ott_vkcount_GetDeviceProcAddr;
    }
    return next_gdpa(dev, name);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL ott_vkcount_GetInstanceProcAddr(VkInstance inst, const char * name) {
    if (!strcmp(name, "vkCreateInstance")) {
        return (PFN_vkVoidFunction) layer_create_instance;
    }
    if (!strcmp(name, "vkCreateDevice")) {
        return (PFN_vkVoidFunction) layer_create_device;
    }
    if (!strcmp(name, "vkGetInstanceProcAddr")) {
        return (PFN_vkVoidFunction) ott_vkcount_GetInstanceProcAddr;
    }
    if (!strcmp(name, "vkGetDeviceProcAddr")) {
        return (PFN_vkVoidFunction) ott_vkcount_GetDeviceProcAddr;
    }
    PFN_vkVoidFunction f = next_gdpa ? layer_device_fn(name) : NULL;
    return f ? f : next_gipa ? next_gipa(inst, name) : NULL;
}
